"""The base of every function over a Hugging Face model (`ModelFunction`) and its config keys
(`ModelFunctionConfig`): model spec, input rows, token rule, tokenizing in chunks, fingerprint,
result schema. The model kinds' bases build on it (`forge.api.causal`); authors import them all
from `forge.api`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from forge.batching.cost import CostModel
from forge.config.schema import positive
from forge.errors import ForgeError
from forge.function import Function
from forge.io.aggregate import Aggregate
from forge.io.inputs import Column, InputSpec, Row
from forge.io.read_marks import mark_every
from forge.io.results import SHARD_BYTES, Field, ResultSchema
from forge.io.rows import read as read_rows_checked
from forge.runtime.forward.request import Forward
from forge.runtime.forward.views import ItemView
from forge.runtime.hooks.interventions import InterventionConfig, Interventions, load_interventions
from forge.runtime.model.spec import HFModel, ModelSpec, open_input
from forge.runtime.tokens.prompts import Prompt, Tokens, sample_output
from forge.runtime.tokens.token_rule import RULE as TOKEN_RULE, TokenRule
from forge.vocab.geometry import Item
from forge.vocab.records import Rejected, Skipped

TOKENIZE_CHUNK = 256  # prompts tokenized per tokenizer call
TEXT_COLUMNS = {"text": Column(required=True), "prefix": Column(), "id": Column(kinds=("string", "integer"))}


@dataclass
class ModelFunctionConfig:
    """The root keys every model function reads; its `config_schema` extends this with its own."""

    model: ModelSpec = field(default_factory=ModelSpec)  # which model, in which precision (model=<name> picks one)
    input: InputSpec = field(default_factory=InputSpec)  # the input rows and how they are read
    shard_size: int = positive(4096)  # rows per results shard
    # interventions at hook points (forge.runtime.hooks.interventions): steering, zero or mean ablation, patching
    intervene: list[InterventionConfig] = field(default_factory=list)


class ModelFunction(Function):
    """Everything a function over one Hugging Face model shares, whatever the model's kind."""

    config_schema: type[ModelFunctionConfig] = ModelFunctionConfig
    fields: tuple[Field | Aggregate, ...] = ()  # result fields, in column order; Aggregates fold over the dataset
    forward: Forward = Forward()
    columns: dict[str, Column] = TEXT_COLUMNS  # input columns read and checked (forge.io.rows)
    format: str = "parquet"  # parquet | safetensors (tensors only)
    folder: str | None = None  # the run directory's subfolder for results (None: the function's name)
    keep_labels: bool = False  # journal each item's label (key "labels")
    shard_bytes: int = SHARD_BYTES  # a shard is also cut once its rows hold this many bytes (per-token results)
    generates: bool = False  # it feeds generated tokens back (intervene span: generated)
    # set by the engine for one run (forge.io.read_marks): where `records` starts reading, (input
    # record, function record), and what it tells, every `mark_every()` input records, the position
    # it reached
    resume_at: tuple[int, int] | None = None
    read_marks: Callable[[int, int], None] | None = None
    # whether a resumed run may start reading at a read mark: true where a row becomes the same
    # records wherever reading starts (no state carried from row to row in `prompts` or `records`)
    seekable: bool = True

    def __init__(self, config: ModelFunctionConfig):
        self.cfg = config  # an instance of config_schema: the function's settings
        self.hf = HFModel(config.model)
        self.input = open_input(config.input, self.columns)  # refuses a bad input
        self.input_path = self.input.path
        self._rule: TokenRule | None = None
        self._warnings: list[str] = []
        self.interventions: Interventions = load_interventions(config.intervene)

    def check_too_long(self, policy: str) -> None:
        if policy == "truncate" and self.forward.targets:
            raise ForgeError(
                f"too_long=truncate cuts items from the right, which would cut the targets {self.name} "
                "scores; use too_long=skip or error"
            )

    # -- what the model is ----------------------------------------------------------
    @property
    def model(self) -> ModelSpec:
        return self.hf.spec

    @property
    def config(self):
        return self.hf.config

    @property
    def tokenizer(self):
        return self.hf.tokenizer

    @property
    def hidden_size(self) -> int:
        """Width of the model's hidden states (its text model's, for a multimodal config)."""
        from forge.runtime.model.hf_compat import text_config

        return int(text_config(self.config).hidden_size)

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process needs: the tokenizer and token rule are rebuilt there on demand."""
        return {**self.__dict__, "_rule": None, "_warnings": [], "read_marks": None}  # the marks: the driver's

    # -- reading rows ---------------------------------------------------------------
    def rows(self, start: int = 0) -> Iterator[Row | Rejected | Skipped]:
        """Every input record from record `start`, checked (`forge.io.rows`): the one place rows are checked."""
        return read_rows_checked(self.input, self.columns, start)

    def prompts(self, row: Row) -> list[Prompt] | str:
        """What a row becomes (or why it cannot become anything): by default one prompt."""
        return [Prompt(row.data["text"], row.data.get("prefix") or None, row.data.get("label"))]

    @property
    def token_rule(self) -> TokenRule:
        if self._rule is None:
            self._rule = TokenRule(self.tokenizer)
        return self._rule

    def records(self) -> Generator[Item | Rejected | Skipped, None, None]:
        """Items in input order. An item's commit key (`Item.index`) counts items, a rejected row
        counting one, so a function that makes one item per row keys each by its row's position."""
        pending: list[tuple[Row, Prompt, int]] = []
        # a resumed run's read mark (forge.io.read_marks): input record `read`, function record `counter`
        read, counter = self.resume_at or (0, 0)
        mark, every = self.read_marks, mark_every()
        for row in self.rows(read) if read else self.rows():
            if mark is not None and read % every == 0:
                mark(read, counter)
            read += 1
            made = row if not isinstance(row, Row) else self.prompts(row)
            if isinstance(made, (Rejected, Skipped, str)):
                yield made if not isinstance(made, str) else cast(Row, row).reject(made)
                counter += 1
                continue
            for p in made:
                pending.append((cast(Row, row), p, counter))
                counter += 1
            if len(pending) >= TOKENIZE_CHUNK:
                yield from self._items(pending)
                pending = []
        yield from self._items(pending)

    def _items(self, pending: list[tuple[Row, Prompt, int]]) -> Iterator[Item | Rejected]:
        from forge.runtime.hooks.row_steer import steer_for
        from forge.runtime.tokens.prompts import make_items, tokenized

        made = tokenized(self.tokenize, [p for _, p, _ in pending])
        return make_items(pending, made, self.forward.targets, self.interventions.key, steer_for(self))

    def tokenize(self, prompts: list[Prompt]) -> list[Tokens | str]:
        """Each prompt's token ids by the token rule (or why it has none); batched over prompts."""
        from forge.runtime.tokens.prompts import by_token_rule

        return by_token_rule(self.token_rule, self.encode_texts, prompts, Tokens)

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of texts without a prefix (the token rule: alone, with the special tokens)."""
        return self.token_rule.texts(texts, with_special=True)

    def expected_items(self) -> int | None:
        return self.input.count()

    def warnings(self) -> list[str]:
        return [*self._warnings, *(self._rule.warnings if self._rule else [])]

    def warn(self, note: str) -> None:
        """A warning for the report, said once."""
        if note not in self._warnings:
            self._warnings.append(note)

    # -- identity and results -----------------------------------------------------------
    def options(self) -> dict[str, Any]:
        """The function's own settings that decide its results (fingerprinted, in meta.json)."""
        return {}

    def fingerprint(self) -> dict[str, Any]:
        return {
            "function": self.name,
            "model": self.hf.identity(),
            "input": self.input.fingerprint(),
            "token_rule": TOKEN_RULE,
            **({"intervene": self.interventions.fingerprint()} if self.interventions else {}),
            **(
                {"aggregates": folds}
                if (folds := [f.as_dict() for f in self.fields if isinstance(f, Aggregate)])
                else {}
            ),
            **self.options(),
        }

    def path(self) -> str:
        """How it runs, in one line (for the report)."""
        return ""

    def describe(self) -> dict[str, Any]:
        return {"model": self.hf.loaded_from or self.hf.source, "input": str(self.input_path), "path": self.path()}

    def result_schema(self) -> ResultSchema:
        return ResultSchema(
            fields=tuple(f for f in self.fields if isinstance(f, Field)),
            aggregates=tuple(f for f in self.fields if isinstance(f, Aggregate)),
            format=self.format,
            folder=self.folder or self.name,
            rows_per_shard=self.cfg.shard_size,
            bytes_per_shard=self.shard_bytes,
            meta_key="labels" if self.keep_labels else None,
            meta={"model": self.model.name, **self.options()},
        )

    def output_bytes(self, items: int, own_tokens: int) -> dict[str, int | None] | None:
        return self.result_schema().output_bytes(items, own_tokens)

    def sample_output(
        self, rows: int, max_seq_len: int | None = None, too_long: str = "skip"
    ) -> tuple[int, int, int] | None:
        return sample_output(self.records(), rows, max_seq_len, too_long)

    def open_sink(self, store):
        from forge.io.sinks import ResultSink

        label = lambda item: getattr(item.meta, "label", item.meta)  # noqa: E731
        return ResultSink(store, self.result_schema(), meta_of=label, finish=getattr(self, "finish", None))

    # -- the author's part ------------------------------------------------------------
    def reduce(self, view: ItemView) -> dict[str, Any]:
        """One item's view -> its result values, {field name: value} (a number, string or tensor)."""
        raise NotImplementedError(f"{type(self).__name__} must define reduce(view)")

    def worker_modules(self) -> list[str]:
        return ["torch", "transformers", "forge.api", type(self).__module__]

    def shape_cost_model(self) -> CostModel:
        """A first-principles memory estimate from the config's sizes (no measurement)."""
        from forge.runtime.cost.models import shape_cost_model

        return shape_cost_model(self.config, self.model.torch_dtype)

    def _reducing_worker(self, views, dispatch=None):
        from forge.runtime.forward.views import ReducingWorker

        folded = [f.name for f in self.fields if isinstance(f, Aggregate)]
        return ReducingWorker(views, self.reduce, [f.name for f in self.fields], folded, dispatch and dispatch.close)
