"""A measured memory model: a batch's peak device bytes, fitted to the model's own forward pass.

Model: the forward pass of `CausalLMRunner` (rows layout) runs on fake tensors (shapes and
dtypes only, no data, no weights loaded) while `MemTracker` follows every allocation and
free; its peak is what the device would hold. For a batch of R rows of S padded slots after
a shared prefix of P tokens, the peak is

    weights + fixed + R*S*a + R*S*(P+S)*b + R*(P+S)*k*[P>0] + P*p

a: per padded token (kept hidden states, transient projections, pooling copies); b: per
attention score or mask entry (query x key pair); k: per token of a row's KV cache, which
holds the expanded prefix and the row's own tokens when there is a prefix (without one,
each layer's KV is transient); p: the prefix's own entry (its 1-row KV, or the 1-row
forward on a cache miss). The
coefficients are fitted (least squares, none negative) to a small sweep of shapes, raised
by a safety margin, and cached on disk per model config, dtype, attention, hidden states kept
and pooling. A function that reads hidden states alone is measured on the model its workers run
once cut past the deepest state (`forge.runtime.cost.models.config_as_run`). `forge.batching`
sees only the resulting `CostModel`: plain numbers, no torch.

A deep model whose layers are all alike (a 7B Llama: 32) is measured at two shallow depths
and each peak extrapolated linearly in layers: weights and the KV a row holds grow by the
same bytes per layer, and the transient activations of one layer do not grow with depth.
Measured exact to the byte on every fit shape: the embedded Llama at 6 layers from 2 and 4,
`examples/models/llama-2-7b` (bfloat16) at 32 from 3 and 5 (58 s instead of 254 s on a shared
2-core CPU), and a small 8-layer config in `tests/test_sim.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge.batching.cost import CostModel
from forge.errors import ForgeError

SCALE_MIN_LAYERS = 8  # deeper models with uniform layers are measured at two shallow depths and extrapolated
FIT_VERSION = 1  # bump when what is measured changes: cached fits are then remeasured
DEFAULT_MARGIN = 0.05  # activations are planned this much above the fit
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def quiet_module_tracking() -> Iterator[None]:
    """Without the warning torch's MemTracker gives when its module stack meets hooks it did not
    expect ("The module hierarchy tracking maybe be messed up"): only its global peak is read here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
        yield


@dataclass(frozen=True, slots=True)
class Shape:
    """One batch shape: `rows` rows of `padded_len` slots after a `prefix_len`-token prefix."""

    rows: int
    padded_len: int
    prefix_len: int = 0
    cached: bool = True  # the prefix's KV comes from the cache (False: computed in this step)


# Shapes the fit is made from: they separate every term (rows, length, length squared, prefix
# per row, prefix once, hit and miss) while staying small enough to measure in seconds.
FIT_SHAPES = (
    Shape(1, 64),
    Shape(4, 256),
    Shape(8, 128),
    Shape(2, 512),
    Shape(4, 64, 256),
    Shape(2, 128, 512),
    Shape(8, 64, 128),
    Shape(1, 256, 256, cached=False),
    Shape(16, 32, 1024),
    Shape(4, 16, 512, cached=False),  # long prefix, short rows: attention's regime
)


@dataclass(frozen=True, slots=True)
class Target:
    """What a fit depends on besides the config: the forward pass that runs."""

    dtype: str = "float32"
    attn: str = "sdpa"
    hidden_kept: int = 1  # distinct hidden-state indices kept (output_hidden_states)
    pooling: str = "last"


def config_hash(config: Any) -> str:
    """The model config's identity (the keys that shape the forward pass)."""
    d = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- measuring


class FakeModel:
    """A causal LM built from its config alone on fake tensors, and the runner's forward pass on it."""

    def __init__(self, config: Any, target: Target, trust_remote_code: bool = False):
        from forge.runtime.model.hf_compat import base_decoder, cache_kwarg

        self.target = target
        self.mode, model = fake_model(_with_attn(config, target.attn), target.dtype, trust_remote_code)
        self.model = model
        self.base = base_decoder(model)
        self.cache_kw = cache_kwarg(self.base)
        self.weight_bytes = state_bytes(self.model)
        n = _num_layers(config)
        self.hs = list(range(n + 1))[-max(1, min(target.hidden_kept, n + 1)) :]
        with self.mode, torch.inference_mode():  # each layer's KV shape, from a one-token step
            from forge.runtime.model.hf_compat import cache_key_values, output_cache

            out = self.base(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)
            self.kv_shapes = [
                ((k.shape[1], k.shape[3], k.dtype), (v.shape[1], v.shape[3], v.dtype))
                for k, v in cache_key_values(output_cache(out))
            ]

    def peak(self, shape: Shape) -> int:
        """Peak bytes (weights included) while one batch of `shape` runs."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(self.model)
        with quiet_module_tracking(), self.mode, tracker, torch.inference_mode():
            kv = self._prefix(shape) if shape.prefix_len else None
            tracker.reset_mod_stats()  # the tracker follows one call per module; the global peak stays
            self._batch(shape, kv)
        peaks = tracker.get_tracker_snapshot("peak")
        return int(max(v.get("Total", 0) for v in peaks.values()))

    def _prefix(self, shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from forge.runtime.model.hf_compat import cache_key_values, output_cache, plain_cache

        P = shape.prefix_len
        if shape.cached:  # the entry as the prefix cache holds it: one row of KV per layer
            return [
                (torch.empty(1, kh, P, kd, dtype=kt), torch.empty(1, vh, P, vd, dtype=vt))
                for (kh, kd, kt), (vh, vd, vt) in self.kv_shapes
            ]
        cache = plain_cache()
        out = self.base(
            input_ids=torch.zeros(1, P, dtype=torch.long),
            position_ids=torch.arange(P).view(1, P),
            use_cache=True,
            output_hidden_states=self.hs,
            **{self.cache_kw: cache},
        )
        produced = output_cache(out)
        kv = cache_key_values(produced if produced is not None else cache)
        [out.hidden_states[i][0, -1].float() for i in self.hs]  # the entry's last states
        return kv

    def _batch(self, shape: Shape, kv) -> None:
        from forge.runtime.model.hf_compat import plain_cache

        R, S, P = shape.rows, shape.padded_len, shape.prefix_len
        kwargs: dict[str, Any] = {"use_cache": False}
        if kv is not None:
            kwargs = {
                self.cache_kw: plain_cache([(k.expand(R, -1, -1, -1), v.expand(R, -1, -1, -1)) for k, v in kv]),
                "use_cache": True,
            }
        out = self.base(
            input_ids=torch.zeros(R, S, dtype=torch.long),
            attention_mask=torch.ones(R, P + S, dtype=torch.long),
            position_ids=(P + torch.arange(S)).repeat(R, 1),
            output_hidden_states=self.hs,
            **kwargs,
        )
        hidden = [out.hidden_states[i] for i in self.hs]
        rows = torch.arange(R)
        for h in hidden:  # pooling, as the runner does it (mean: every token, as float32)
            if self.target.pooling == "mean":
                vals = h.reshape(R * S, -1).float()
                torch.zeros(R, h.shape[-1]).index_add_(0, rows.repeat_interleave(S), vals)
            else:
                h[rows, torch.full((R,), S - 1)].float()


def fake_model(
    config: Any, dtype: str = "float32", trust_remote_code: bool = False, auto: Any = None
) -> tuple[Any, Any]:
    """(its FakeTensorMode, a model built from `config` on fake tensors in eval mode, by the
    transformers auto class `auto`, a causal LM by default): shapes and dtypes only, no data,
    so a 7B model builds in seconds in no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if auto is None:
        from transformers import AutoModelForCausalLM as auto

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = auto.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return mode, model.eval()


def state_bytes(model: Any) -> int:
    """The bytes of a model's parameters and buffers, as its state dict holds them."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _with_attn(config: Any, attn: str) -> Any:
    import copy

    config = copy.deepcopy(config)
    try:
        config._attn_implementation = attn
    except Exception:  # noqa: BLE001  (older configs: set the private attribute)
        config._attn_implementation_internal = attn
    return config


def _num_layers(config: Any) -> int:
    from forge.runtime.model.hf_compat import num_layers

    return num_layers(config)


def scaling_depths(config: Any, target: Target) -> tuple[int, int] | None:
    """Two shallow depths to measure at, when the model is deep and its layers all alike; else None."""
    from forge.runtime.model.hf_compat import text_config

    c = text_config(config)
    n = getattr(c, "num_hidden_layers", None)
    if not isinstance(n, int) or n < SCALE_MIN_LAYERS or c is not config:
        return None
    types = getattr(c, "layer_types", None)
    if types and len(set(types)) > 1:  # sliding and full layers alternate: measure the whole model
        return None
    low = max(2, target.hidden_kept)  # every depth keeps the same number of hidden states
    return (low, low + 2) if low + 2 < n else None


def at_depth(config: Any, layers: int) -> Any:
    """`config` with only its first `layers` layers (and their layer types)."""
    import copy

    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = layers
    if getattr(shallow, "layer_types", None):
        shallow.layer_types = list(shallow.layer_types)[:layers]
    return shallow


def measure_by_depth(
    config: Any,
    target: Target,
    depths: tuple[int, int],
    trust_remote_code: bool = False,
    fake: Any = None,
    shapes: tuple[Shape, ...] = FIT_SHAPES,
) -> tuple[list[int], int]:
    """Peaks of `shapes` and the weight bytes at the config's depth, extrapolated linearly
    from two shallow depths (`fake`: what is measured, as in `fitted_cost_model`)."""
    n = config.num_hidden_layers
    (d1, d2), measured = depths, []
    for d in depths:
        model = (fake or FakeModel)(at_depth(config, d), target, trust_remote_code)
        measured.append(([model.peak(s) for s in shapes], model.weight_bytes))
    (p1, w1), (p2, w2) = measured
    scale = (n - d1) / (d2 - d1)
    peaks = [int(round(a + (b - a) * scale)) for a, b in zip(p1, p2)]
    return peaks, int(round(w1 + (w2 - w1) * scale))


# ----------------------------------------------------------------------------- fitting


def features(shape: Shape) -> list[float]:
    """The terms of the model above, for one shape: fixed, R*S, R*S*(P+S), R*(P+S)*[P>0], P."""
    R, S, P = shape.rows, shape.padded_len, shape.prefix_len
    return [1.0, R * S, R * S * (P + S), R * (P + S) if P else 0, P]


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with no negative coefficient: drop the most negative term and refit."""
    active = list(range(x.shape[1]))
    sw = np.sqrt(w)[:, None]
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active] * sw, y * sw[:, 0], rcond=None)[0]
        if (coef >= 0).all() or not active:
            return coef
        active.remove(int(np.argmin(coef)))


def upper_fit(x: np.ndarray, y: np.ndarray, tau: float = 0.95, rounds: int = 30) -> np.ndarray:
    """An upper expectile fit: under-predictions weigh `tau`, over-predictions 1 - tau.

    The peak is the larger of a few stages (attention at long keys, the MLP at long rows), a
    maximum of linear terms; a plain least-squares line through it would cut below it about
    half the time, an upper expectile stays on or above it.
    """
    w = np.ones(len(y))
    coef = nonneg_lstsq(x, y, w)
    for _ in range(rounds):
        w_new = np.where(x @ coef < y, tau, 1 - tau)
        if np.array_equal(w_new, w):
            break
        w = w_new
        coef = nonneg_lstsq(x, y, w)
    return coef


def fit(shapes: Iterable[Shape], peaks: Iterable[int], weight_bytes: int, margin: float = DEFAULT_MARGIN) -> CostModel:
    """The `CostModel` that fits the measured peaks from above, activations raised by `margin`."""
    shapes, peaks = list(shapes), list(peaks)
    x = np.array([features(s) for s in shapes], dtype=np.float64)
    y = np.array(peaks, dtype=np.float64) - weight_bytes
    scale = x.max(axis=0)
    scale[scale == 0] = 1
    fixed, a, b, k, p = upper_fit(x / scale, y) / scale
    up = 1 + margin
    return CostModel(
        weight_bytes=int(weight_bytes + np.ceil(fixed * up)),
        bytes_per_token=float(a * up),
        bytes_per_score=float(b * up),
        kv_bytes_per_token=float(k * up),
        prefix_bytes_per_token=float(p * up),
        margin=margin,
    )


# ----------------------------------------------------------------------------- cached entry point


def cache_dir() -> Path:
    from forge.runtime.model.embedded import default_cache_dir

    return default_cache_dir() / "memory_fits"


def _write(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as exc:
        raise ForgeError(f"memory fit: cannot write {path} ({exc}); set FORGE_CACHE to a writable directory") from None


def fitted_cost_model(
    config: Any,
    target: Target,
    trust_remote_code: bool = False,
    margin: float = DEFAULT_MARGIN,
    directory: Path | None = None,
    fake: Any = None,
    shapes: tuple[Shape, ...] = FIT_SHAPES,
    kind: str = "",
) -> CostModel:
    """The measured `CostModel` of this model and forward pass: from the disk cache, else fitted now.

    `fake` builds what is measured (default `FakeModel`, the causal LM runner's forward; any class
    with `weight_bytes` and `peak(shape)`), over `shapes`; `kind` names it in the cache key."""
    directory = directory or cache_dir()
    key = (
        f"{config_hash(config)}-{target.dtype}-{target.attn}-h{target.hidden_kept}-{target.pooling}"
        f"-m{margin}-v{FIT_VERSION}"
    )
    key += f"-{kind}" if kind else ""
    path = directory / f"{key}.json"
    if path.is_file():
        try:
            record = json.loads(path.read_text())
            return CostModel(**{"margin": record.get("margin", 0.0), **record["cost_model"]})
        except (ValueError, TypeError, KeyError):
            pass  # unreadable or stale: fit again
    depths = scaling_depths(config, target)
    if depths is None:
        model = (fake or FakeModel)(config, target, trust_remote_code)
        peaks, weight_bytes = [model.peak(s) for s in shapes], model.weight_bytes
    else:
        peaks, weight_bytes = measure_by_depth(config, target, depths, trust_remote_code, fake, shapes)
    cost = fit(shapes, peaks, weight_bytes, margin)
    record = {
        "cost_model": asdict(cost),
        "target": asdict(target),
        "margin": margin,
        "extrapolated_from_layers": list(depths) if depths else None,
        "sweep": [{**asdict(s), "peak_bytes": p} for s, p in zip(shapes, peaks)],
    }
    _write(path, record)
    return cost
