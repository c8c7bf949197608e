"""generate: text from a causal LM for each row, greedy or sampled, with continuous batching, and
optionally the activations of the generated tokens; steered by ``intervene:``.

Rows: ``prompt`` (the text), optional ``prompt_ids`` (the prompt's token ids, run as given: no
special tokens added, ``prompt`` then only names the row; lm-eval's `--model forge` cuts contexts
so), optional ``prefix`` (a shared few-shot prefix: token rule as everywhere, its KV shared between
the prompts of a batch), ``id``, ``max_new_tokens`` (this row's limit) and ``stop`` (a string or
a list: the text ends before the first one found). Per row, Parquet:
``generated_ids`` (int32, ragged), ``text``, ``finish_reason`` (length | stop | eos),
``num_prompt_tokens`` and ``num_generated_tokens``; with ``layers`` / ``capture``, per generated
token (and, ``states_of: all``, per prompt token after the prefix first) the states from a plain
forward over the final sequence, as ragged float32 columns ``layer_<L>`` / ``<point>`` beside them.

Everything else is `forge.api.GenerativeFunction`'s: Forge's continuous-batching decoder, its step
and KV budgets, the refusal of models it cannot run, rows committed in parts as they finish.
Greedy output equals one-prompt-at-a-time `generate` token for token, in every batching mode
(tests/test_generate.py), steered or not (tests/test_generate_steering.py); ``sampling`` draws each
row's tokens from its own stream, seeded by (seed, id): a row's text does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.api import (
    Column,
    Field,
    Forward,
    GenerativeConfig,
    GenerativeFunction,
    MayBeEmpty,
    Prompt,
    Row,
    Tokens,
    one_of,
)

FINISH = ("length", "stop", "eos")


@dataclass
class IdsPrompt(Prompt):
    """A prompt a row gave as token ids (``prompt_ids``): tokenized by nobody."""

    ids: list[int] = field(default_factory=list)


@dataclass
class GenerateConfig(GenerativeConfig):
    """The root keys generate reads (beside every generative function's)."""

    layers: list[int] = field(default_factory=list)  # hidden_states[L] of the generated tokens (0 = embeddings)
    capture: list[str] = field(default_factory=list)  # hook points kept for the generated tokens (as probe_gen's)
    states_of: str = one_of("generated", "generated", "all")  # all: the prompt's own tokens' states too


class Generate(GenerativeFunction):
    name = "generate"
    config_schema = GenerateConfig
    # with prompt_ids the prompt only names the row, and may be empty (lm-eval's empty contexts)
    columns = {"prompt": MayBeEmpty(required=True), "prefix": Column(), "id": Column(kinds=("string", "integer"))}
    fields = (
        Field("generated_ids", "int32", (), ragged=True),
        Field("text", "string"),
        Field("finish_reason", "string"),
        Field("num_prompt_tokens", "int32"),
        Field("num_generated_tokens", "int32"),
    )

    def __init__(self, config: GenerateConfig):
        self.forward = Forward(layers=tuple(config.layers), capture=tuple(config.capture))
        super().__init__(config)
        self.states_of_prompt = config.states_of == "all"
        names = [f"layer_{layer}" for layer in config.layers] + list(config.capture)
        self.fields = Generate.fields + tuple(Field(n, "float32", None, ragged=True) for n in names)

    def options(self) -> dict[str, Any]:
        states = {"layers": list(self.forward.layers), "capture": list(self.forward.capture)} if self.states else {}
        return {**super().options(), **states}

    def prompts(self, row: Row) -> list[Prompt] | str:
        limits = self.row_limits(row)
        if isinstance(limits, str):
            return limits
        data = row.data
        ids = data.get("prompt_ids")
        if ids is None:
            if not data["prompt"].strip():
                said = repr(data["prompt"])
                return f"has an empty 'prompt' ({said}); every row needs a non-empty 'prompt', or 'prompt_ids'"
            return [Prompt(data["prompt"], data.get("prefix") or None, data.get("label"), limits)]
        vocab = len(self.tokenizer)
        if not isinstance(ids, list) or not ids or not all(_token_id(i, vocab) for i in ids):
            return f"'prompt_ids' must be a non-empty list of token ids (0..{vocab - 1}); fix it or give 'prompt' alone"
        if data.get("prefix"):
            return "has both 'prompt_ids' and 'prefix'; put the prefix's ids at the start of prompt_ids"
        return [IdsPrompt(data["prompt"], None, data.get("label"), limits, ids=list(ids))]

    def tokenize(self, prompts: list[Prompt]) -> list[Tokens | str]:
        """By the token rule, except the prompts a row gave as ids."""
        texts = iter(super().tokenize([p for p in prompts if not isinstance(p, IdsPrompt)]))
        return [Tokens([], p.ids) if isinstance(p, IdsPrompt) else next(texts) for p in prompts]


def _token_id(value: Any, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
