"""embed: sentence embeddings of texts from any Hugging Face encoder (BERT-style) or decoder.

Token rule (every batching mode uses it): a text is tokenized alone, with the tokenizer's
special tokens ([CLS] ... [SEP] for BERT), truncated to `max_seq_length` tokens, as
sentence-transformers tokenizes it for the same model (its `max_seq_length` and `do_lower_case`
come from the model's `sentence_bert_config.json` when there is one; sentence-transformers
prompts are not added). Items have no shared prefix.

Pooling over the text's tokens (special tokens included, as sentence-transformers does):
`mean`, `cls` (the first token; encoders only) or `last`; `normalize: true` divides each
vector by its L2 norm. Encoders run whole texts in rows or packed rows
(`forge.runtime.encoder`); decoders run through the causal LM runner, taking its final
normed hidden state. Output: safetensors or Parquet shards (`forge.functions.embed_sink`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from forge.batching.memory import CostModel
from forge.errors import ForgeError
from forge.function import Function
from forge.geometry import Batch, Device, Item
from forge.inputs import Column, InputFile, Row, each_row, string_problem
from forge.run import Rejected, Skipped
from forge.schema import one_of, positive
from forge.store import RunStore
from forge.functions.embed_sink import FORMATS, EmbeddingSink, load_embeddings  # noqa: F401  (the reader, re-exported)
from forge.functions.probe_gen import DTYPES, InputSpec, ModelSpec, ProbeGen, _line, resolve_input, resolve_model_source

TOKENIZE_CHUNK = 256
TOKEN_RULE = "text alone with special tokens, truncated to max_seq_length (sentence-transformers) (v1)"
COLUMNS = {"text": Column(required=True), "id": Column(kinds=("string", "integer"))}
UNBOUNDED = 1_000_000  # tokenizers report a huge model_max_length when they know none


@dataclass
class EmbedConfig:
    """The root keys embed reads (its constructor's parameters), checked at the edge."""

    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    pooling: str = one_of("mean", "mean", "cls", "last")
    normalize: bool = True  # divide each vector by its L2 norm
    max_seq_length: Optional[int] = positive(None)  # truncate texts to this many tokens; null: the model's
    output_format: str = one_of("safetensors", *FORMATS)
    shard_size: int = positive(4096)


class Embed(Function):
    name = "embed"
    config_schema = EmbedConfig

    def __init__(self, model: dict, input: dict, pooling: str = "mean", normalize: bool = True,
                 max_seq_length: int | None = None, output_format: str = "safetensors", shard_size: int = 4096):
        self.model = ModelSpec(**model)
        if self.model.torch_dtype not in DTYPES:
            raise ForgeError(f"model.torch_dtype={self.model.torch_dtype!r}; choose one of {', '.join(DTYPES)}")
        if output_format not in FORMATS:
            raise ForgeError(f"output_format={output_format!r}; choose one of: {', '.join(FORMATS)}")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.output_format = output_format
        self.shard_size = int(shard_size)
        self.input = InputFile(resolve_input(str(input["path"])), input, COLUMNS)  # refuses a bad input now
        self.input_path, self.input_limit = self.input.path, self.input.limit
        self.source = resolve_model_source(self.model.name)
        self._config = None
        self._tokenizer = None
        self._warnings: list[str] = []
        self._truncated = 0  # texts that reached max_seq_length (cut to it, or exactly that long)
        self._model_path: str | None = None
        self._mode = (False, False)  # (packed, prefix cache) until check_mode says
        self._read_capabilities()
        st = self._st_config()
        # sentence-transformers' own settings for this model, when it ships them
        self.max_seq_length = max_seq_length or st.get("max_seq_length") or self._tokenizer_max_length()
        self.lowercase = bool(st.get("do_lower_case", False))  # texts lowercased before tokenizing

    # -- what the model is (no weights) ---------------------------------------------
    config = ProbeGen.config  # AutoConfig, loaded once, with one-line errors
    tokenizer = ProbeGen.tokenizer

    def _read_capabilities(self) -> None:
        from forge.runtime.capabilities import capabilities, causal_lm_class
        from forge.runtime.encoder import encoder_capabilities, encoder_class

        cls = causal_lm_class(self.config)
        caps = capabilities(self.config, cls, self.model.attn_implementation)
        self.causal = caps.causal  # a decoder: runs as probe_gen does; else a bidirectional encoder
        self.caps = caps if caps.causal else encoder_capabilities(self.config, self.model.attn_implementation)
        if not self.causal and encoder_class(self.config) is None:
            raise ForgeError(f"model.name={self.model.name}: transformers has neither an encoder (AutoModel) nor a "
                             f"causal LM class for model_type {getattr(self.config, 'model_type', '?')!r}")
        if self.causal and self.pooling == "cls":
            raise ForgeError(f"pooling=cls is not meaningful for {caps.family}: a causal decoder computes its first "
                             "token without seeing the rest of the text; use pooling=mean or pooling=last")

    def _st_config(self) -> dict[str, Any]:
        """The model directory's sentence_bert_config.json (max_seq_length, do_lower_case), or {}."""
        path = Path(self.source) / "sentence_bert_config.json"
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            raise ForgeError(f"model.name={self.model.name}: {path} is not valid JSON; fix or remove it") from None
        length = data.get("max_seq_length")
        if length is not None and (not isinstance(length, int) or length < 1):
            raise ForgeError(f"model.name={self.model.name}: {path} has max_seq_length={length!r}; "
                             "set max_seq_length=N to override it")
        return data

    def _tokenizer_max_length(self) -> int | None:
        value = getattr(self.tokenizer, "model_max_length", None)
        return int(value) if isinstance(value, int) and 0 < value < UNBOUNDED else None

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = False) -> None:
        """Refuse, before any work, a layout that cannot equal a one-text forward pass. Items have
        no prefix, so only packing (and, for an encoder, the prefix cache) matter."""
        if self.causal:
            self.caps.check(False, packed)
        else:
            self.caps.check(packed, cache)
        self._mode = (packed, cache)

    def path(self) -> str:
        packed, _ = self._mode
        if self.causal:
            return self.caps.path(False, packed, False) + "; texts have no prefix"
        return self.caps.path(packed)

    def cost_model(self) -> CostModel:
        """Measured on fake tensors and cached (`forge.runtime.memory_fit`); from the shape if that fails."""
        from forge.runtime.memory_fit import FIT_SHAPES, Target, fitted_cost_model

        attn = self.caps.attn or "eager"
        try:
            if self.causal:
                target = Target(dtype=self.model.torch_dtype, attn=attn, hidden_kept=1,
                                pooling="mean" if self.pooling == "mean" else "last")
                return fitted_cost_model(self.config, target, bool(self.model.trust_remote_code))
            from forge.runtime.encoder import FakeEncoder

            target = Target(dtype=self.model.torch_dtype, attn=attn, hidden_kept=1, pooling="mean")
            shapes = tuple(s for s in FIT_SHAPES if not s.prefix_len)
            return fitted_cost_model(self.config, target, bool(self.model.trust_remote_code), fake=FakeEncoder,
                                     shapes=shapes, kind="encoder")
        except ForgeError:
            raise
        except Exception as exc:  # noqa: BLE001  (any tracker failure: fall back, say so)
            note = (f"memory model: measuring {self.model.name} on fake tensors failed ({_line(exc)}); "
                    "batching=memory plans from a first-principles estimate of its shape")
            if note not in self._warnings:
                self._warnings.append(note)
            return ProbeGen.shape_cost_model(self)  # reads only self.config and self.model

    def fingerprint(self) -> dict[str, Any]:
        config = {k: v for k, v in self.config.to_dict().items()
                  if not k.startswith("_") and k != "transformers_version"}
        return {
            "function": self.name,
            "model": {**asdict(self.model),
                      "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()},
            "input": self.input.fingerprint(),
            "pooling": self.pooling,
            "normalize": self.normalize,
            "max_seq_length": self.max_seq_length,
            "lowercase": self.lowercase,
            "output_format": self.output_format,
            "token_rule": TOKEN_RULE,
        }

    def worker_modules(self) -> list[str]:
        runtime = "forge.runtime.causal_lm" if self.causal else "forge.runtime.encoder"
        return ["torch", "transformers", __name__, runtime]

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process needs: the tokenizer is rebuilt there on demand."""
        state = dict(self.__dict__)
        state.update(_tokenizer=None, _warnings=[])
        return state

    def describe(self) -> dict[str, Any]:
        return {"model": self._model_path or self.source, "input": str(self.input_path), "path": self.path()}

    def expected_items(self) -> int | None:
        return self.input.count()

    def warnings(self) -> list[str]:
        notes = list(self._warnings)
        if self._truncated:
            notes.append(f"{self._truncated} texts reached max_seq_length={self.max_seq_length} tokens: longer ones "
                         "are truncated to it (as sentence-transformers does); set max_seq_length to change it")
        return notes

    # -- items --------------------------------------------------------------------
    def records(self) -> Iterator[Item | Rejected | Skipped]:
        chunk: list[Row] = []
        for row in self.input.rows():
            if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
                yield row
                continue
            problem = string_problem(row.data, "text", required=True)
            if problem is not None:
                yield row.reject(problem)
                continue
            chunk.append(row)
            if len(chunk) >= TOKENIZE_CHUNK:
                yield from each_row(chunk, self._tokenize, "tokenizing")
                chunk = []
        if chunk:
            yield from each_row(chunk, self._tokenize, "tokenizing")

    def _tokenize(self, chunk: list[Row]) -> Iterator[Item]:
        limit = self.max_seq_length
        texts = [row.data["text"].lower() if self.lowercase else row.data["text"] for row in chunk]
        ids = self.tokenizer(texts, add_special_tokens=True, truncation=limit is not None,
                             max_length=limit)["input_ids"]
        if limit is not None:
            self._truncated += sum(len(t) >= limit for t in ids)
        for row, tokens in zip(chunk, ids):
            yield Item(row.id, len(tokens), None, 0, tokens, None, row.index)

    # -- running ------------------------------------------------------------------
    def open_worker(self, device: Device, cache_tokens: int) -> "EmbedWorker":
        import torch
        from transformers import AutoModel, AutoModelForCausalLM

        from forge.functions.assets import materialize_model

        path = str(materialize_model(Path(self.source))) if Path(self.source).is_dir() else self.source
        self._model_path = path
        kwargs: dict[str, Any] = {"dtype": getattr(torch, self.model.torch_dtype),
                                  "attn_implementation": self.caps.attn, **self.model.hub_kwargs()}
        loader = AutoModelForCausalLM if self.causal else AutoModel
        try:
            model = loader.from_pretrained(path, **kwargs)
        except OSError as exc:
            raise ForgeError(f"model.name={self.model.name}: cannot load weights from {path} ({_line(exc)})") from None
        model.to(device.torch_device).eval()
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else 0
        if self.causal:
            from forge.runtime.causal_lm import CausalLMRunner
            from forge.runtime.hf_compat import num_layers

            layer = num_layers(self.config)  # the final normed hidden state (last_hidden_state)
            runner = CausalLMRunner(model, layers=[layer], pooling=self.pooling, cache_tokens=0,
                                    pad_token_id=pad, caps=self.caps)
            return EmbedWorker(runner, layer, self.normalize)
        from forge.runtime.encoder import EncoderRunner

        return EmbedWorker(EncoderRunner(model, self.caps, self.pooling, self.normalize, pad), None, self.normalize)

    def open_sink(self, store: RunStore) -> EmbeddingSink:
        meta = {"pooling": self.pooling, "normalize": self.normalize, "model": self.model.name,
                "dim": int(getattr(self.config, "hidden_size", 0) or 0), "max_seq_length": self.max_seq_length}
        return EmbeddingSink(store, self.output_format, meta, self.shard_size)


@dataclass
class EmbedOutput:
    """What a worker returns for a batch: plain arrays, so it crosses a process boundary."""

    vectors: np.ndarray  # float32 [n_items, dim], batch.items order
    prefix_computed_tokens: int = 0  # texts have no prefix
    cache_hit: bool = False


class EmbedWorker:
    def __init__(self, runner, layer: int | None, normalize: bool):
        self.runner = runner
        self.layer = layer  # decoders: the hidden-state index pooled; None for an encoder
        self.normalize = normalize

    def run(self, batch: Batch) -> EmbedOutput:
        batch = replace(batch, split_prefix=False)  # no item has a prefix: rows hold whole texts
        if self.layer is None:
            return EmbedOutput(self.runner.run(batch).numpy())
        from forge.runtime.encoder import pool_and_normalize

        pooled = self.runner.run(batch).pooled[self.layer]
        return EmbedOutput(pool_and_normalize(pooled, self.normalize).numpy())

    def close(self) -> None:
        self.runner = None
