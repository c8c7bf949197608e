"""embed: sentence embeddings of texts from any Hugging Face encoder (BERT-style) or decoder.

Written on `forge.api`: `Embed` picks `EncoderEmbed` (an `EncoderFunction`) or `DecoderEmbed`
(a `CausalLMFunction`) from the model's config; both compute the same thing, said once here.

Token rule: a text is tokenized alone, with the tokenizer's special tokens ([CLS] ... [SEP] for
BERT), truncated to `max_seq_length` tokens, as sentence-transformers tokenizes it for the same
model (its `max_seq_length` and `do_lower_case` come from the model's `sentence_bert_config.json`
when there is one; sentence-transformers prompts are not added). Items have no shared prefix.

Pooling over the text's final hidden states (special tokens included, as sentence-transformers
does): `mean`, `cls` (the first token; encoders only) or `last`; `normalize: true` divides each
vector by its L2 norm. Output: `embedding` (float32 [dim]) per text under ``embeddings/``,
safetensors or Parquet (`load_embeddings`, or `forge.io.results.load`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from forge.api import (
    CausalLMFunction,
    Column,
    EncoderFunction,
    Field,
    ForgeError,
    Forward,
    ItemView,
    ModelFunctionConfig,
    Prompt,
    Row,
    one_of,
    positive,
)

FORMATS = ("safetensors", "parquet")
UNBOUNDED = 1_000_000  # tokenizers report a huge model_max_length when they know none
FINAL = -1  # the final hidden state (a decoder's normed output, an encoder's last_hidden_state)


@dataclass
class EmbedConfig(ModelFunctionConfig):
    """The root keys embed reads, checked at the edge."""

    # mean: over every token (special tokens included) | cls: the first token (encoders) | last
    pooling: str = one_of("mean", "mean", "cls", "last")
    normalize: bool = True  # divide each vector by its L2 norm
    # truncate texts to this many tokens; null: sentence-transformers' value for the model, else the tokenizer's
    max_seq_length: int | None = positive(None)
    output_format: str = one_of("safetensors", *FORMATS)  # safetensors | parquet


class _Embedding:
    """What embed computes, whichever kind of model runs it (mixed into an API base)."""

    name = "embed"
    config_schema = EmbedConfig
    folder = "embeddings"
    columns = {"text": Column(required=True), "id": Column(kinds=("string", "integer"))}
    forward = Forward(layers=(FINAL,))

    def __init__(self, config: EmbedConfig):
        if config.output_format not in FORMATS:
            raise ForgeError(f"output_format={config.output_format!r}; choose one of: {', '.join(FORMATS)}")
        self.pooling, self.normalize, self.format = config.pooling, bool(config.normalize), config.output_format
        super().__init__(config)
        st = self._st_config()  # sentence-transformers' own settings for this model, when it ships them
        self.max_seq_length = config.max_seq_length or st.get("max_seq_length") or self._tokenizer_max_length()
        self.lowercase = bool(st.get("do_lower_case", False))  # texts lowercased before tokenizing
        self.fields = (Field("embedding", "float32", (int(getattr(self.config, "hidden_size", 0) or 0),)),)
        self._truncated = 0  # texts that reached max_seq_length (cut to it, or exactly that long)

    def _st_config(self) -> dict[str, Any]:
        """The model directory's sentence_bert_config.json (max_seq_length, do_lower_case), or {}."""
        path = Path(self.hf.source) / "sentence_bert_config.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            raise ForgeError(f"model.name={self.model.name}: {path} is not valid JSON; fix or remove it") from None
        length = data.get("max_seq_length")
        if length is not None and (not isinstance(length, int) or length < 1):
            raise ForgeError(
                f"model.name={self.model.name}: {path} has max_seq_length={length!r}; "
                "set max_seq_length=N to override it"
            )
        return data

    def _tokenizer_max_length(self) -> int | None:
        value = getattr(self.tokenizer, "model_max_length", None)
        return int(value) if isinstance(value, int) and 0 < value < UNBOUNDED else None

    def options(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_seq_length": self.max_seq_length,
            "lowercase": self.lowercase,
            "output_format": self.format,
        }

    def prompts(self, row: Row) -> list[Prompt]:
        text = row.data["text"]
        return [Prompt(text.lower() if self.lowercase else text)]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        limit = self.max_seq_length
        ids = self.tokenizer(texts, add_special_tokens=True, truncation=limit is not None, max_length=limit)[
            "input_ids"
        ]
        self._truncated += sum(len(t) >= limit for t in ids) if limit is not None else 0
        return ids

    def warnings(self) -> list[str]:
        notes = list(super().warnings())
        if self._truncated:
            notes.append(
                f"{self._truncated} texts reached max_seq_length={self.max_seq_length} tokens: longer ones "
                "are truncated to it (as sentence-transformers does); set max_seq_length to change it"
            )
        return notes

    def reduce(self, view: ItemView) -> dict[str, Any]:
        import torch

        h = view.hidden[FINAL]
        v = {"mean": lambda: h.float().mean(0), "cls": lambda: h[0].float(), "last": lambda: h[-1].float()}[
            self.pooling
        ]()
        return {"embedding": torch.nn.functional.normalize(v, p=2, dim=0) if self.normalize else v}


class EncoderEmbed(_Embedding, EncoderFunction):
    """embed on a bidirectional encoder: whole texts in rows or packed rows."""


class DecoderEmbed(_Embedding, CausalLMFunction):
    """embed on a causal decoder: its final normed hidden state; texts have no prefix."""

    def __init__(self, config: EmbedConfig):
        super().__init__(config)
        if self.pooling == "cls":
            raise ForgeError(
                f"pooling=cls is not meaningful for {self.caps.family}: a causal decoder computes its "
                "first token without seeing the rest of the text; use pooling=mean or pooling=last"
            )

    def memory_pooling(self) -> str:
        return "mean" if self.pooling == "mean" else "last"

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = False) -> None:
        super().check_mode(False, packed, False)  # no prefix: only packing matters

    def path(self) -> str:
        return super().path() + "; texts have no prefix"


class Embed:
    """The `embed` function: an `EncoderEmbed` or a `DecoderEmbed`, as the model's config says."""

    name = "embed"
    config_schema = EmbedConfig

    def __new__(cls, config: EmbedConfig):
        from forge.api import HFModel, capabilities

        spec = config.model
        decoder = capabilities(HFModel(spec).config, None, spec.attn_implementation).causal
        return (DecoderEmbed if decoder else EncoderEmbed)(config)


class Embeddings(NamedTuple):
    ids: list[str]  # item ids, in input order
    vectors: np.ndarray  # float32 [N, dim], aligned with ids


def load_embeddings(run_dir) -> Embeddings:
    """ids and float32 vectors [N, dim] of an `embed` run (a local path or an fsspec URL), in input order."""
    from forge.api import load_results as load

    res = load(run_dir, "embeddings")
    return Embeddings(res.ids, res.columns["embedding"])
