"""Small shims over transformers versions (4.x and 5.x): config, cache and output access, and where
a model (placed over several devices by `forge.runtime.placement.dispatch`, or on one) computes."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def num_layers(config: Any) -> int:
    cfg = text_config(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(cfg, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot tell how many layers {type(config).__name__} has")


def outside_decoder(model: Any, module: Any) -> str | None:
    """The base decoder's name in `model` when `module` is not part of it (None: it is)."""
    base = base_decoder(model)
    if any(m is module for m in base.modules()):
        return None
    return next((n for n, m in model.named_modules() if m is base), "") or type(base).__name__


def base_decoder(model: Any) -> Any:
    """A causal LM's base decoder (its `get_decoder()`, else its `base_model_prefix` attribute,
    else the model itself): what runs the layers and returns hidden states."""
    get = getattr(model, "get_decoder", None)
    if get is not None:
        try:
            base = get()
        except Exception:  # noqa: BLE001  (exotic wrappers)
            base = None
        if base is not None and base is not model:
            return base
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return base if base is not None else model


LOADED_LAYERS = (
    "forge_loaded_layers"  # on a model loaded cut (forge.runtime.placement.dispatch): the decoder layers it holds
)


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device, else its first weight's
    (a weight on the meta device is offloaded: the CPU computes it unless a hook says otherwise)."""
    hook = getattr(module, "_hf_hook", None)
    for h in [hook, *getattr(hook, "hooks", ())]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def input_device(model: Any) -> torch.device:
    """Where a model's token ids go: its input embeddings' execution device."""
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if get is not None else None
    return execution_device(embed if isinstance(embed, torch.nn.Module) else model)


def layers_to_run(indices: list[int], total: int) -> int:
    """The decoder layers a function that reads only the hidden states `indices` (resolved, in
    0..total) needs: one past the deepest, since state `total` is taken after the final norm."""
    return min(total, max(indices, default=total) + 1)


def keep_first_layers(base: torch.nn.Module, total: int, keep: int) -> bool:
    """Cut the decoder `base` to its first `keep` of `total` layers, where it holds them as its one
    ModuleList of `total` modules (every family tested does); False, leaving it whole, otherwise.
    Hidden state i < keep is the same either way: a layer's output depends on those before it
    alone. (State `keep` is the last, after the final norm: so keep one layer past the deepest.)"""
    if keep >= total:
        return False
    lists = [(n, m) for n, m in base.named_children() if isinstance(m, torch.nn.ModuleList) and len(m) == total]
    if len(lists) != 1:
        return False
    name, layers = lists[0]
    setattr(base, name, torch.nn.ModuleList(list(layers)[:keep]))
    return True


def cache_kwarg(module: torch.nn.Module) -> str:
    """`cache` on transformers 5.x, `past_key_values` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def plain_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A DynamicCache whose every layer keeps all its keys (no sliding-window trimming).

    Built without the model's config on purpose: a config makes sliding layers keep only
    their last window-1 tokens, and a shared prefix must keep every key so that Forge's own
    per-layer masks decide what each query sees.
    """
    from transformers import DynamicCache

    if kv is None:
        return DynamicCache()
    try:
        return DynamicCache(ddp_cache_data=kv)
    except TypeError:  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(kv))  # type: ignore[attr-defined]  # gone in 5's stubs  # gone from transformers 5's stubs


def cache_key_values(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers 5.x
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.x


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def prebuild_load_tables() -> bool:
    """Build now what transformers builds at a process's first `from_pretrained` and keeps in a
    module global (its table of checkpoint conversions: about a thousand regular expressions, for
    every family), so that processes forked after this inherit it; False where this transformers
    has no such table."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    get_checkpoint_conversion_mapping("llama")  # any family's lookup builds the whole table
    return True


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> the probe's answer


def probes_causal(base: Any, config: Any, device: Any) -> bool:
    """Whether changing a later token leaves earlier states alone (a 3-token probe forward), once
    per model object: a model kept across runs (forge.Session, forge server) is probed once."""
    if base in _PROBED:
        return _PROBED[base]
    vocab = int(getattr(text_config(config), "vocab_size", 8) or 8)
    a, b, c, d = (i % vocab for i in (1, 2, 3, 4))
    ids = torch.tensor([[a, b, c], [a, b, d]], device=device)
    try:
        with torch.inference_mode():
            out = base(input_ids=ids, use_cache=False)
    except Exception:
        return False  # not remembered: a failure may be the moment's (memory), not the model's
    h = out.last_hidden_state[:, :2].float()
    _PROBED[base] = bool(torch.allclose(h[0], h[1], rtol=1e-3, atol=1e-4))
    return _PROBED[base]
