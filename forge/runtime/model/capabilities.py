"""What a causal LM can do exactly, read from its config and class (no weights).

`capabilities(config, model_class)` answers, before any work: is the model causal (by
architecture), which attention implementation to load (`auto`: SDPA where the class
supports it, else eager), what its layers attend to (full or sliding window, per layer),
whether its positions are ALiBi biases, and whether its forward takes one mask per layer
type. From that, `Capabilities.refusal(split_prefix, packed)` says why a layout cannot
equal a one-prompt forward pass (or None), and `path(...)` states the path taken in one line.

Layouts (see forge.runtime.forward.causal_lm): rows of whole sequences always run; a split prefix
(prefix KV run once or cached, rows of suffixes) and packed rows need a causal decoder whose
every layer keeps a plain key/value cache. Sliding windows are exact under both: Forge keeps
every prefix key and masks, per layer type, the keys a full forward pass would not show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forge.errors import ForgeError
from forge.runtime.model.class_facts import ClassFacts, class_facts, facts_of
from forge.runtime.model.hf_compat import num_layers, text_config

FULL, SLIDING = "full_attention", "sliding_attention"
MASK_IMPLS = ("sdpa", "eager")  # implementations that honour an explicit 4D mask
ATTN_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
#: what transformers' layer types other than attention are, in a refusal's words
LAYER_KINDS = {
    "linear_attention": "state-space, recurrent or linear-attention",
    "hybrid": "attention and state-space together",
    "conv": "short-convolution",
}


@dataclass(frozen=True)
class Capabilities:
    family: str  # config.model_type
    model_class: str
    causal: bool
    not_causal: str  # why not, when not causal
    attn: str  # the attention implementation to load
    attn_note: str  # why that one
    layer_types: tuple[str, ...]  # per layer: full_attention, sliding_attention, or another kind
    windows: tuple[int, ...]  # distinct sliding windows (empty: none)
    mask_mapping: bool  # the forward takes {layer type: mask}
    alibi: bool  # positions are ALiBi biases built from the 2D mask
    learned_positions: bool  # absolute position embeddings (GPT-2, OPT)
    softcap: float | None  # attention logit soft-capping
    model_module: str | None = None  # where the class lives (its worker's fork server preloads it)

    @property
    def mixed_layers(self) -> bool:
        return len(set(self.layer_types)) > 1

    def refusal(self, split_prefix: bool, packed: bool) -> str | None:
        """Why this layout cannot equal a one-prompt forward pass; None when it can."""
        if not (split_prefix or packed):
            return None
        if not self.causal:
            return f"it is not causal ({self.not_causal}): a prefix's keys would depend on the text after it"
        odd = sorted(set(self.layer_types) - {FULL, SLIDING})
        if odd:
            kinds = ", ".join(f"{kind} ({LAYER_KINDS[kind]})" if kind in LAYER_KINDS else kind for kind in odd)
            return f"it has {kinds} layers, which keep no plain key/value cache"
        if packed and self.alibi:
            return "ALiBi biases follow each key's place in the row, not its position in its own prompt"
        if packed and self.attn not in MASK_IMPLS:
            return f"packed rows need a 4D mask, which {self.attn} attention does not take"
        if len(self.windows) > 1:
            return f"its sliding layers have different windows ({', '.join(map(str, self.windows))})"
        if self.windows and self.attn not in MASK_IMPLS:
            return f"its sliding windows need a 4D mask per layer type, which {self.attn} attention does not take"
        if self.windows and self.mixed_layers and not self.mask_mapping:
            return "it mixes full and sliding-window layers but its forward takes one mask for all of them"
        return None

    def check(self, split_prefix: bool, packed: bool) -> None:
        """Raise a one-line ForgeError when the layout cannot be exact; name the one that works."""
        reason = self.refusal(split_prefix, packed)
        if reason is None:
            return
        if packed and self.refusal(True, False) is None:
            setting, fix = "batching.packing=packed", "batching.packing=rows"
        else:
            setting = "batching.packing=packed" if packed else "batching.prefix_cache=true"
            fix = "batching.prefix_cache=false batching.packing=rows (or batching=item)"
        raise ForgeError(f"{setting} is not exact for {self.family}: {reason}; use {fix}")

    def path(self, split_prefix: bool, packed: bool, cache: bool) -> str:
        """One line: attention implementation, prefix handling, packing, and what shaped them."""
        parts = [f"{self.family}: {self.attn} attention ({self.attn_note})"]
        if split_prefix:
            parts.append("prefix run once per batch" + ("; prefix cache on" if cache else "; prefix cache off"))
        else:
            parts.append("whole prompts per row; prefix cache off")
        parts.append("packed rows on" if packed else "packed rows off")
        notes = []
        if self.windows and (split_prefix or packed):
            kinds = "per layer type" if self.mixed_layers else "for every layer"
            notes.append(f"sliding window {'/'.join(map(str, self.windows))} masked {kinds}")
        if self.alibi:
            notes.append("ALiBi positions" + ("" if packed else ": packed rows not exact"))
        if self.learned_positions:
            notes.append("learned absolute positions")
        if self.softcap:
            notes.append(f"attention soft-capping {self.softcap:g}")
        return "; ".join(parts) + ("" if not notes else " [" + "; ".join(notes) + "]")


def causal_lm_facts(config: Any) -> ClassFacts:
    """The facts about the class AutoModelForCausalLM loads for this config (no weights; kept
    between runs, `forge.runtime.model.class_facts`)."""
    return class_facts(config, "AutoModelForCausalLM")


def _declares(config: Any, name: str) -> bool:
    return any(
        name in vars(c).get("__annotations__", {})
        for c in type(config).__mro__[:-1]
        if c.__module__.startswith("transformers.models.")
    )


def _not_causal(config: Any, facts: ClassFacts) -> str:
    """Why this is not a causal decoder, or "" when it is (by architecture, not by probing)."""
    cfg = text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder"
    if facts.name is None:
        return f"transformers has no causal LM class for model_type {getattr(config, 'model_type', '?')!r}"
    if getattr(cfg, "is_causal", True) is False or getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    # encoder families (BERT, RoBERTa, ...) are causal only when configured as decoders
    if _declares(cfg, "add_cross_attention") and _declares(cfg, "is_decoder") and not cfg.is_decoder:
        return "an encoder unless is_decoder=true"
    return ""


def _layer_types(cfg: Any) -> tuple[list[str], list[int | None]]:
    """Per layer: its attention kind and window, as transformers' own cache would lay it out."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        found, kwargs = get_layer_types_and_kwargs(cfg)
        return list(found), [k.get("sliding_window") if t == SLIDING else None for t, k in zip(found, kwargs)]
    except ImportError:  # older transformers
        n = num_layers(cfg)
        types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if types is None:
            types = [SLIDING if window else FULL] * n
        return list(types), [window if t == SLIDING else None for t in types]


def choose_attn(family: str, facts: ClassFacts, requested: str | None) -> tuple[str, str]:
    """(implementation, why): `auto` takes SDPA where the class supports it, else eager."""
    requested = requested or "auto"
    if requested not in ATTN_CHOICES:
        raise ForgeError(f"model.attn_implementation={requested!r}; choose one of {', '.join(ATTN_CHOICES)}")
    if requested == "auto":
        if facts.name is None or facts.supports_attn("sdpa"):
            return "sdpa", "auto: SDPA supported"
        return "eager", "auto: no SDPA support"
    if facts.name is not None and not facts.supports_attn(requested):
        raise ForgeError(f"model.attn_implementation={requested}: {family} does not support it; use auto or eager")
    return requested, "set by model.attn_implementation"


def capabilities(
    config: Any, model_class: type | ClassFacts | None = None, attn_implementation: str | None = "auto"
) -> Capabilities:
    """Capabilities of the causal LM `config` describes (no weights are loaded); `model_class`
    (a class or its facts) defaults to the one AutoModelForCausalLM loads."""
    if isinstance(model_class, ClassFacts):
        facts = model_class
    else:
        facts = facts_of(model_class) if model_class is not None else causal_lm_facts(config)
    cfg = text_config(config)
    family = str(getattr(cfg, "model_type", None) or getattr(config, "model_type", "model"))
    attn, note = choose_attn(family, facts, attn_implementation)
    types, wins = _layer_types(cfg)
    return Capabilities(
        family=family,
        model_class=facts.name or "?",
        model_module=facts.module,
        causal=not _not_causal(config, facts),
        not_causal=_not_causal(config, facts),
        attn=attn,
        attn_note=note,
        layer_types=tuple(types),
        windows=tuple(sorted({int(w) for w in wins if w})),
        mask_mapping=facts.mask_mapping,
        alibi=bool(
            getattr(cfg, "alibi", False)
            or family in ("bloom", "mpt")
            or getattr(cfg, "position_embedding_type", "") == "alibi"
        ),
        learned_positions=family in ("gpt2", "opt", "gpt_bigcode", "biogpt", "xglm"),
        softcap=getattr(cfg, "attn_logit_softcapping", None) or None,
    )


def causal_lm_capabilities(config: Any, model: Any, source: str) -> Capabilities:
    """`capabilities` of a causal LM, its class from the model's own code (`auto_map`) when
    transformers has none and the config trusts remote code (`model`: the `ModelSpec`)."""
    facts = causal_lm_facts(config)
    auto_map = getattr(config, "auto_map", None) or {}
    if facts.name is None and "AutoModelForCausalLM" in auto_map and model.trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        facts = facts_of(get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], source, **model.hub_kwargs()))
    return capabilities(config, facts, model.attn_implementation)
