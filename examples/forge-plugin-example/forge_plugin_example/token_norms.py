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
from forge.inputs import check_input, count_rows, read_rows
from forge.results import Field, ResultSchema
from forge.run import Rejected
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
        self.input_path = check_input(resolve_input(str(input["path"])), columns=COLUMNS)
        self.input_limit = input.get("limit")
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
    def records(self) -> Iterator[Item | Rejected]:
        prefixes: dict[str, tuple[str, list[int]]] = {}
        for index, row in read_rows(self.input_path, self.input_limit):
            if isinstance(row, str):
                yield Rejected(row.split(":", 1)[0], row)
                continue
            rid = str(row["id"]) if row.get("id") is not None else str(index)
            text, prefix = row.get("text"), row.get("prefix") or None
            if not isinstance(text, str) or not text.strip():
                yield Rejected(rid, f"row {index} (id {rid}) has no non-empty string 'text'; every row needs one")
                continue
            if prefix is not None and not isinstance(prefix, str):
                yield Rejected(rid, f"row {index} (id {rid}): 'prefix' must be a string; fix it or leave it out")
                continue
            if prefix is None:
                tokens = self.tokenizer(text, add_special_tokens=True)["input_ids"]
                yield Item(rid, len(tokens), None, 0, tokens, row.get("label"), index)
                continue
            if prefix not in prefixes:
                prefixes[prefix] = (hashlib.sha1(prefix.encode()).hexdigest()[:12],
                                    self.tokenizer(prefix, add_special_tokens=True)["input_ids"])
            key, prefix_ids = prefixes[prefix]
            tokens = prefix_ids + self.tokenizer(text, add_special_tokens=False)["input_ids"]
            yield Item(rid, len(tokens), key, len(prefix_ids), tokens, row.get("label"), index)

    def expected_items(self) -> int | None:
        rows = count_rows(self.input_path)
        return rows if self.input_limit is None else min(rows, self.input_limit)

    # -- results ----------------------------------------------------------------
    def result_schema(self) -> ResultSchema:
        return ResultSchema(fields=(Field("num_tokens", "int64"), Field("mean_norm", "float32"),
                                    Field("max_norm", "float32")),
                            format="parquet", folder="token_norms", rows_per_shard=self.shard_size,
                            meta={"model": self.model.name})

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.input_path.read_bytes()).hexdigest()
        return {"function": self.name, "model": asdict(self.model),
                "input": {"path": str(self.input_path), "sha256": digest, "limit": self.input_limit}}

    def describe(self) -> dict[str, Any]:
        return {"model": self.source, "input": str(self.input_path),
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
