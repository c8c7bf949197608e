"""What Forge's decoder can run and what it holds: the model refusal and the memory estimate.

`decoder_refusal` says why a model's cache cannot go through the decoder (before any work);
`step_activation_bytes` is the most one engine step holds beside weights and keys and values, from
the model's shape; `least_kv_bytes` (forge.runtime.decoder.sequence) the KV budget one sequence needs.
"""

from __future__ import annotations

from typing import Any


def decoder_refusal(config: Any, model_module: str | None = None) -> str | None:
    """Why Forge's decoder cannot run this model (None: it can): it places keys and values per layer
    in slots, so a cache holding anything else (a recurrent state, layers sharing KV, a cache class
    of the model's own, in `model_module`) is refused."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        return f"its layers include {', '.join(map(str, other))}, not attention with keys and values per layer"
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build a cache for
        return f"transformers builds no cache for its config ({type(exc).__name__}: {exc})"
    layers = int(config.get_text_config().num_hidden_layers)
    plain = (DynamicLayer, DynamicSlidingWindowLayer)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) not in plain}
    if kinds:
        return f"its cache holds {', '.join(sorted(kinds))} (recurrent or shared state), not keys and values per layer"
    if cache.layers and len(cache.layers) != layers:
        return f"its cache has {len(cache.layers)} layers for {layers} decoder layers (layers share KV)"
    own = own_cache_classes(config, model_module)
    if own:
        return f"its model code keeps its own cache ({', '.join(own)}), not keys and values per layer"
    return None


def own_cache_classes(config: Any, model_module: str | None) -> list[str]:
    """The `Cache` classes that `model_module` (the model's code) defines itself. Reading them
    imports the modeling code, about 1 s of a CPU core that `forge run`'s own process otherwise
    never spends (its workers import it, in a fork server started first), so the names are kept
    with the class's other facts (`forge.runtime.model.class_facts`) and read once per
    transformers version and config class."""
    if not model_module:
        return []
    from forge.runtime.model.class_facts import class_fact

    return list(class_fact(config, "AutoModelForCausalLM", f"own_caches {model_module}", lambda: _own(model_module)))


def _own(model_module: str) -> list[str]:
    import importlib

    from transformers.cache_utils import Cache

    try:
        module = importlib.import_module(model_module)
    except ImportError:
        return []
    found = vars(module).items()
    return sorted(n for n, o in found if isinstance(o, type) and issubclass(o, Cache) and o.__module__ == model_module)


def step_activation_bytes(
    config: Any, torch_dtype: str, tokens: int, max_seq_len: int, logit_rows: int | None = None
) -> int:
    """The most one engine step of `tokens` tokens holds beside weights and KV, from the model's
    shape (no measurement): every token's transients, its scores over at most max_seq_len keys,
    and a float32 row of logits for each of `logit_rows` (None: every token, as a decode step's
    rows; a prefill step keeps one a prompt)."""
    from forge.runtime.cost.models import shape_cost_model

    shape = shape_cost_model(config, torch_dtype)
    vocab = int(config.get_text_config().vocab_size)
    rows = tokens if logit_rows is None else logit_rows
    return int(tokens * (shape.bytes_per_token + max_seq_len * shape.bytes_per_score) + rows * 2 * 4 * vocab)
