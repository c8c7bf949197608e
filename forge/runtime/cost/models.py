"""The memory cost models of a Hugging Face model function (`forge.api.ModelFunction`), for
batching=memory: its forward pass measured on fake tensors (`forge.runtime.cost.memory_fit`), or,
where that fails, a first-principles estimate from the config's sizes.

`causal_lm_cost_model` and `encoder_cost_model` take the function itself (its `config`,
`model`, `caps`, `forward` and `warn`); `forge.api` calls them from `cost_model`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from forge.batching.cost import CostModel
from forge.errors import ForgeError
from forge.runtime.model.spec import DTYPES, first_line

LOGIT_COPIES = 3  # target scoring holds float32 [tokens, vocab] logits about three times (cast, log_softmax, argmax)


def _target(fn: Any, pooling: str):
    from forge.runtime.cost.memory_fit import Target

    return Target(
        dtype=fn.model.torch_dtype,
        attn=fn.caps.attn or "eager",
        hidden_kept=max(1, len(set(fn.forward.layers))),
        pooling=pooling,
    )


def _fell_back(fn: Any, exc: Exception) -> CostModel:
    fn.warn(
        f"memory model: measuring {fn.model.name} on fake tensors failed ({first_line(exc)}); "
        "batching=memory plans from a first-principles estimate of its shape"
    )
    return fn.shape_cost_model()


def config_as_run(config: Any, layers: tuple[int, ...], trust_remote_code: bool = False) -> Any:
    """The config of the model a worker runs when its function reads the hidden states `layers`
    alone: the workers cut the decoder one layer past the deepest (`CausalLMRunner`,
    `hf_compat.keep_first_layers`), so their steps hold those layers' weights and KV only.
    `config` itself where nothing is cut: the deepest is the last, a nested (multimodal) config,
    or a family whose decoder the cut does not apply to (tried once on a 2-layer fake model of
    it, and kept with the class's facts: a later run imports no modeling code for it)."""
    from forge.runtime.cost.memory_fit import at_depth
    from forge.runtime.forward.items import resolve_layers
    from forge.runtime.model.class_facts import class_fact
    from forge.runtime.model.hf_compat import layers_to_run, num_layers, text_config

    n = num_layers(config)
    keep = layers_to_run(resolve_layers(layers, n, allow_empty=True), n)
    depth = getattr(config, "num_hidden_layers", None)
    if keep >= n or text_config(config) is not config or not isinstance(depth, int):
        return config
    cut = class_fact(config, "AutoModelForCausalLM", "first_layers_cut", lambda: _cuts(config, trust_remote_code))
    return at_depth(config, keep) if cut else config


def _cuts(config: Any, trust_remote_code: bool) -> bool:
    """Whether a worker cuts this family's decoder (`hf_compat.keep_first_layers`), tried on a
    2-layer model of it on fake tensors."""
    from forge.runtime.cost.memory_fit import at_depth, fake_model
    from forge.runtime.model.hf_compat import base_decoder, keep_first_layers

    try:
        _, probe = fake_model(at_depth(config, 2), trust_remote_code=trust_remote_code)
        return keep_first_layers(base_decoder(probe), 2, 1)
    except Exception:  # noqa: BLE001  (a family that cannot be built shallow: priced whole, which is safe)
        return False


def causal_lm_cost_model(fn: Any, forward: Any = None) -> CostModel:
    """The forward pass measured on fake tensors (cached; from the shape if that fails), plus
    per token: float32 logits when targets are scored, and the function's own extras. A function
    that reads hidden states alone is measured on the layers its workers keep (`config_as_run`):
    they cut the decoder before it goes to the device."""
    from forge.runtime.cost.memory_fit import fitted_cost_model
    from forge.runtime.model.hf_compat import text_config

    trust = bool(fn.model.trust_remote_code)
    forward = fn.forward if forward is None else forward  # (what the forward pass gives, if not fn.forward)
    config = fn.config if forward.lm_head else config_as_run(fn.config, layers_read(fn), trust)
    try:
        base = fitted_cost_model(config, _target(fn, fn.memory_pooling()), trust)
    except ForgeError:
        raise
    except Exception as exc:  # noqa: BLE001  (any tracker failure: fall back, say so)
        base = _fell_back(fn, exc)
    extra = fn.extra_bytes_per_token()
    cfg, size = text_config(fn.config), DTYPES[fn.model.torch_dtype]
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if forward.lm_head:
        extra += vocab * (size + 4 * LOGIT_COPIES)
    if forward.logits == "all" or forward.head:
        extra += vocab * 4 * LOGIT_COPIES  # logits kept at every token / view.head's float32 logits
    widths = [_capture_width(cfg, name) for name in forward.capture]
    extra += size * sum(w for w in widths if w)  # each capture keeps its value at every token until reduced
    scores = base.bytes_per_score + size * int(getattr(cfg, "num_attention_heads", 0) or 0) * widths.count(0)
    return replace(base, bytes_per_token=base.bytes_per_token + extra, bytes_per_score=scores)


def _capture_width(cfg: Any, name: str) -> int:
    """Values a capture keeps per token (0: an attention pattern, kept per score); a module path:
    the widest of the hidden and MLP sizes."""
    kind = name.rpartition(".")[0]
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    if kind == "attn_pattern":
        return 0
    if kind in ("resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_out"):
        return hidden
    return max(hidden, int(getattr(cfg, "intermediate_size", 0) or 0))


def layers_read(fn: Any) -> tuple[int, ...]:
    """Hidden-state indices a function's forward pass must reach: its layers and, for each
    capture at layer L, L + 1 (a module path outside the layers: all of them)."""
    from forge.runtime.hooks.points import parse_point
    from forge.runtime.model.hf_compat import num_layers

    n = num_layers(fn.config)
    out = list(fn.forward.layers)
    for name in fn.forward.capture:
        point = parse_point(name, n)
        layer = point.layer if point.kind != "module" else _module_layer(name)
        out.append(n if layer is None else layer + 1)
    return tuple(out)


def _module_layer(path: str) -> int | None:
    """The layer index a module path names (``model.layers.3.mlp``: 3), read from the path."""
    parts = path.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "h", "layer", "blocks") and b.isdigit():
            return int(b)
    return None


def encoder_cost_model(fn: Any) -> CostModel:
    """An encoder's forward pass measured on fake tensors (whole texts: no prefix shapes)."""
    from forge.runtime.cost.fake_encoder import FakeEncoder
    from forge.runtime.cost.memory_fit import FIT_SHAPES, fitted_cost_model

    shapes = tuple(s for s in FIT_SHAPES if not s.prefix_len)
    try:
        return fitted_cost_model(
            fn.config,
            _target(fn, "mean"),
            bool(fn.model.trust_remote_code),
            fake=FakeEncoder,
            shapes=shapes,
            kind="encoder",
        )
    except ForgeError:
        raise
    except Exception as exc:  # noqa: BLE001
        return _fell_back(fn, exc)


def check_layers(layers: tuple[int, ...], n: int) -> None:
    """Hidden-state indices must name one of the model's 0..n (negative ones count from the end: -1 = n)."""
    bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not -(n + 1) <= x <= n]
    if bad:
        raise ForgeError(
            f"layers={list(layers)}: the model has {n} layers; choose layers in 0..{n} "
            "(0 = embeddings; -1 = the final one)"
        )


def shape_cost_model(config: Any, torch_dtype: str) -> CostModel:
    """A first-principles estimate from the config's sizes (no measurement)."""
    from forge.runtime.model.hf_compat import num_layers, text_config

    c = text_config(config)
    hidden, layers = c.hidden_size, num_layers(c)
    inter = next(
        (v for v in (getattr(c, k, None) for k in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")) if v),
        4 * hidden,
    )
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    per_layer = hidden * head_dim * (heads * 2 + kv_heads * 2) + 3 * hidden * inter + 2 * hidden
    embed = c.vocab_size * hidden * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return CostModel.from_shape(
        num_params=embed + layers * per_layer + hidden,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=inter,
        dtype_bytes=DTYPES[torch_dtype],
    )
