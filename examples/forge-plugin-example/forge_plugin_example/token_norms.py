"""token_norms: per row, its token count and the mean and largest L2 norm of the model's input
embeddings of its tokens. Written as a Parquet table through Forge's generic sink.

Items follow probe_gen's token rule (a prefix tokenized alone with the special tokens, then
the text without them), so rows that share a prefix share a prefix key and Forge groups and
routes them together. A worker looks up each item's whole token sequence (prefix included)
in the embedding table, whatever the batch's layout, so every batching mode gives the same
numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from forge.function import Function, ItemColumns
from forge.functions.probe_gen import COLUMNS, InputSpec, ModelSpec, resolve_input, resolve_model_source
from forge.geometry import Batch, Device, Item
from forge.inputs import InputFile, Row, string_problem
from forge.results import Field, ResultSchema
from forge.run import Rejected, Skipped
from forge.schema import positive


@dataclass
class TokenNormsConfig:
    """The root keys token_norms reads (its constructor's parameters)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    shard_size: int = positive(4096)


class TokenNorms(Function):
    name = "token_norms"
    config_schema = TokenNormsConfig

    def __init__(self, model: dict, input: dict, shard_size: int = 4096):
        self.model = ModelSpec(**model)
        self.source = resolve_model_source(self.model.name)
        # Forge's reader: the id rule, input.duplicate_ids and input.max_row_bytes, bad rows as failures
        self.input = InputFile(resolve_input(str(input["path"])), input, COLUMNS)
        self.shard_size = int(shard_size)
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.source, **self.model.hub_kwargs())
        return self._tokenizer

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    # -- items ------------------------------------------------------------------
    def records(self) -> Iterator[Item | Rejected | Skipped]:
        prefixes: dict[str, tuple[str, list[int]]] = {}
        for row in self.input.rows():
            if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
                yield row
                continue
            problem = (string_problem(row.data, "text", required=True)
                       or string_problem(row.data, "prefix", required=False, empty_ok=True))
            if problem is not None:
                yield row.reject(problem)
                continue
            rid, index, text, prefix = row.id, row.index, row.data["text"], row.data.get("prefix") or None
            if prefix is None:
                tokens = self.tokenizer(text, add_special_tokens=True)["input_ids"]
                yield Item(rid, len(tokens), None, 0, tokens, row.data.get("label"), index)
                continue
            if prefix not in prefixes:
                prefixes[prefix] = (hashlib.sha1(prefix.encode()).hexdigest()[:12],
                                    self.tokenizer(prefix, add_special_tokens=True)["input_ids"])
            key, prefix_ids = prefixes[prefix]
            tokens = prefix_ids + self.tokenizer(text, add_special_tokens=False)["input_ids"]
            yield Item(rid, len(tokens), key, len(prefix_ids), tokens, row.data.get("label"), index)

    def expected_items(self) -> int | None:
        return self.input.count()

    # -- results ----------------------------------------------------------------
    def result_schema(self) -> ResultSchema:
        return ResultSchema(fields=(Field("num_tokens", "int64"), Field("mean_norm", "float32"),
                                    Field("max_norm", "float32")),
                            format="parquet", folder="token_norms", rows_per_shard=self.shard_size,
                            meta={"model": self.model.name})

    def fingerprint(self) -> dict[str, Any]:
        return {"function": self.name, "model": asdict(self.model), "input": self.input.fingerprint()}

    def describe(self) -> dict[str, Any]:
        return {"model": self.source, "input": str(self.input.path),
                "path": "input embeddings of each item's tokens (any layout gives the same numbers)"}

    # -- running ----------------------------------------------------------------
    def open_worker(self, device: Device, cache_tokens: int) -> "NormsWorker":
        import torch
        from transformers import AutoModelForCausalLM

        from forge.functions.assets import materialize_model

        path = str(materialize_model(Path(self.source))) if Path(self.source).is_dir() else self.source
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.model.torch_dtype),
                                                     **self.model.hub_kwargs())
        embeddings = model.get_input_embeddings().to(device.torch_device).eval()
        return NormsWorker(embeddings, device.torch_device)


class NormsWorker:
    """Looks each item's tokens up in the embedding table; norms per token, then per item."""

    def __init__(self, embeddings, torch_device: str):
        self.embeddings = embeddings  # the model's input embedding module, on the device
        self.torch_device = torch_device

    def run(self, batch: Batch) -> ItemColumns:
        import torch

        items = batch.items
        longest = max(it.num_tokens for it in items)
        ids = torch.zeros((len(items), longest), dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.bool)
        for row, it in enumerate(items):
            ids[row, :it.num_tokens] = torch.as_tensor(list(it.tokens))
            mask[row, :it.num_tokens] = True
        with torch.no_grad():
            norms = self.embeddings(ids.to(self.torch_device)).float().norm(dim=-1).cpu()
        counts = mask.sum(dim=1)
        mean = (norms * mask).sum(dim=1) / counts
        largest = norms.masked_fill(~mask, float("-inf")).max(dim=1).values
        # every item's prefix was looked up with it: nothing came from a prefix cache
        return ItemColumns({"num_tokens": counts.numpy().astype(np.int64), "mean_norm": mean.numpy(),
                            "max_norm": largest.numpy()},
                           prefix_computed_tokens=batch.prefix_tokens if batch.split_prefix else 0, cache_hit=False)

    def close(self) -> None:
        self.embeddings = None
