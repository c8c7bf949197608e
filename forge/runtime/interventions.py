"""Interventions: a function's `intervene:` entries, checked, with their vectors loaded.

An entry (`InterventionConfig`, one per list element of the function's ``intervene:`` key):

    intervene:
      - at: resid_post.2        # a hook point (forge.runtime.hooks): a Forge name or a module path
        op: add                 # add: value + scale * vector (steering) | set: the vector instead
                                # (patching a stored activation; mean ablation with a stored mean) | zero
        vector: dirs.npy        # add/set: a list of numbers, or a file: .npy, .pt, .safetensors#key,
                                # or a run's dataset result: run:<run dir>#<name>[/<label>]
        scale: 4.0              # add: the multiple of the vector added
        span: text              # text (the item's own tokens) | prefix | all | last (its last own
                                # token) | [positions] (from the start of the sequence, prefix included)
                                # | generated (generate: each generated token as it is fed back)

Every layout applies an entry to the same tokens (`forge.runtime.hooks.Slots`), so results stay
equal to a plain one-prompt forward pass with the same hook. An entry that can reach prefix
tokens (span prefix, all or positions) changes the prefix's keys, so the function's prefix keys
carry the interventions' fingerprint (`Interventions.key`): a cached unsteered prefix is never
served to a steered item.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forge.errors import ForgeError

OPS = ("add", "set", "zero")
SPANS = ("text", "prefix", "all", "last", "generated")  # generated: the tokens generate feeds back (generate only)
WIDE_POINTS = ("resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_out")  # one hidden-size vector per token


@dataclass
class InterventionConfig:
    """One ``intervene:`` entry as written in YAML (checked by `load_interventions`)."""

    at: str = ""  # the hook point: resid_pre.L, resid_post.L, attn_out.L, mlp_in.L, mlp_out.L or a module path
    op: str = "add"  # add (steering) | set (patch / mean-ablate with the given vector) | zero
    vector: Any = None  # add/set: numbers, or a file (.npy, .pt, .safetensors#key) or run:<dir>#<name>[/<label>]
    scale: float = 1.0  # add: the multiple of the vector added
    span: Any = "text"  # text | prefix | all | last | a list of positions (prefix included, from 0)


@dataclass(frozen=True)
class Intervention:
    """One checked intervention; `apply` changes a hook point's value on the masked slots."""

    at: str
    op: str
    vector: tuple[float, ...] | None  # add/set: the vector (the value's last dimension)
    scale: float
    span: str | tuple[int, ...]
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def apply(self, value: Any, mask: Any) -> Any:
        """`value` [rows, tokens, ...] with this intervention on the slots where `mask` [rows, tokens]."""
        import torch

        m = mask.view(*mask.shape, *([1] * (value.dim() - 2)))
        if self.op == "zero":
            return value.masked_fill(m, 0)
        key = (value.device, value.dtype)
        vec = self._cache.get(key)
        if vec is None:
            vec = self._cache[key] = torch.tensor(self.vector, dtype=value.dtype, device=value.device)
        if vec.shape[-1] != value.shape[-1]:
            raise ValueError(
                f"intervention at {self.at!r}: its vector has {vec.shape[-1]} values, the hook point's value "
                f"has {value.shape[-1]} per token"
            )
        if self.op == "add":
            return torch.where(m, value + self.scale * vec, value)
        return torch.where(m, vec.expand_as(value), value)

    def describe(self) -> dict[str, Any]:
        digest = (
            None if self.vector is None else hashlib.sha256(np.asarray(self.vector, np.float64).tobytes()).hexdigest()
        )
        span = list(self.span) if isinstance(self.span, tuple) else self.span
        return {"at": self.at, "op": self.op, "scale": self.scale, "span": span, "vector_sha256": digest}

    @property
    def touches_prefix(self) -> bool:
        return self.span in ("prefix", "all") or isinstance(self.span, tuple)


@dataclass(frozen=True)
class Interventions:
    """A function's interventions, in the order they apply at each point."""

    items: tuple[Intervention, ...] = ()

    def fingerprint(self) -> list[dict[str, Any]]:
        return [iv.describe() for iv in self.items]

    @property
    def key(self) -> str | None:
        """What the prefix keys carry (None: no intervention reaches a prefix token)."""
        if not any(iv.touches_prefix for iv in self.items):
            return None
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return "iv-" + hashlib.sha256(blob).hexdigest()[:16]

    def __bool__(self) -> bool:
        return bool(self.items)

    def check_widths(self, hidden_size: int, function: str, where: str = "intervene") -> None:
        """Refuse, before any work, a vector whose length is not the model's hidden size at a
        named point (each holds one hidden-size vector per token). A module path's width is known
        only once it runs: there a wrong length fails the batch's items, with the reason."""
        for k, iv in enumerate(self.items):
            kind = iv.at.rpartition(".")[0]
            if iv.vector is not None and kind in WIDE_POINTS and len(iv.vector) != hidden_size:
                raise ForgeError(
                    f"{function}: {where}[{k}] at {iv.at!r}: its vector has {len(iv.vector)} values, but the "
                    f"model's hidden size is {hidden_size}"
                )


def load_interventions(entries: Any, where: str = "intervene") -> Interventions:
    """The ``intervene:`` list checked and its vectors loaded (ForgeError naming the entry otherwise)."""
    out = []
    for k, raw in enumerate(entries or ()):
        get = raw.get if isinstance(raw, dict) else lambda name, default=None, r=raw: getattr(r, name, default)
        at, op = str(get("at", "") or ""), str(get("op", "add"))
        name = f"{where}[{k}]"
        if not at:
            raise ForgeError(f"{name}.at is missing: name a hook point such as resid_post.2 or mlp_out.1")
        if op not in OPS:
            raise ForgeError(f"{name}.op={op!r}; choose one of: {', '.join(OPS)}")
        span = _span(get("span", "text"), name)
        vector = None if op == "zero" else _vector(get("vector"), name, op)
        try:
            scale = float(get("scale", 1.0))
        except (TypeError, ValueError):
            raise ForgeError(f"{name}.scale={get('scale')!r}: give a number") from None
        out.append(Intervention(at, op, vector, scale, span))
    return Interventions(tuple(out))


def _span(span: Any, name: str) -> str | tuple[int, ...]:
    if isinstance(span, str):
        if span not in SPANS:
            raise ForgeError(f"{name}.span={span!r}; choose one of: {', '.join(SPANS)}, or a list of positions")
        return span
    try:
        positions = tuple(_position(p) for p in span)
    except (TypeError, ValueError):
        raise ForgeError(f"{name}.span={span!r}; choose one of: {', '.join(SPANS)}, or a list of positions") from None
    if not positions:
        raise ForgeError(f"{name}.span=[]: name at least one position (or span: all)")
    if any(p < 0 for p in positions):
        raise ForgeError(
            f"{name}.span={list(positions)}: positions count from 0 at the sequence's first token (use span: last "
            "for the last token)"
        )
    return positions


def _position(p: Any) -> int:
    """A whole number (2 or 2.0), never a bool or 2.5."""
    if isinstance(p, bool) or not float(p).is_integer():
        raise ValueError(p)
    return int(p)


def _vector(source: Any, name: str, op: str) -> tuple[float, ...]:
    if source is None:
        raise ForgeError(f"{name}.vector is missing: op={op} needs a vector (numbers or a file)")
    if isinstance(source, str):
        values = read_vector(source, name)
    else:
        try:
            values = np.asarray(list(source), dtype=np.float64)
        except (TypeError, ValueError):
            raise ForgeError(f"{name}.vector: give a list of numbers or a file path") from None
    if values.ndim != 1 or not values.size or not np.isfinite(values).all():
        raise ForgeError(f"{name}.vector: need one finite vector (1-D), got shape {values.shape}")
    return tuple(float(v) for v in values)


def read_vector(source: str, name: str) -> np.ndarray:
    """A vector from a file (.npy, .pt, .safetensors#key) or a run's dataset result (run:<dir>#<name>[/<label>])."""
    path, _, key = source.partition("#")
    try:
        if path.startswith("run:"):
            from forge.io.results import aggregate

            what, _, label = key.partition("/")
            value: Any = aggregate(path[4:])[what]
            if label:
                value = {str(k): v for k, v in value.items()}[label]
            return np.asarray(value, np.float64)
        if path.endswith(".npy"):
            return np.load(path).astype(np.float64)
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            tensors = load_file(path)
            return np.asarray(tensors[key] if key else next(iter(tensors.values())), np.float64)
        if path.endswith(".pt"):
            import torch

            return torch.load(path, map_location="cpu", weights_only=True).double().numpy()
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ForgeError(f"{name}.vector={source!r}: {type(exc).__name__}: {exc}") from None
    raise ForgeError(f"{name}.vector={source!r}: use a .npy, .pt or .safetensors#key file, or run:<dir>#<name>")
