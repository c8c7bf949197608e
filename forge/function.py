"""The function seam: what a Forge function provides to the engine.

Authors do not implement this ABC directly: `forge.api` (`CausalLMFunction`, `EncoderFunction`)
implements it once for every function over a Hugging Face model, and a function declares only
its result fields, what its forward pass must give and a reduction of one item's view
(docs/functions.md). This module is the engine's side of that contract.

A function is a class (this ABC) plus a YAML file in a `conf/function/` directory. It
declares:

* how rows become items, with their token geometry (`records`: `Item`s, `Rejected` rows);
* what a worker computes for a batch (`open_worker`: the model is loaded once per device);
* its result schema and how outputs are committed (`result_schema`: fields, safetensors
  shards or Parquet table rows; the generic sink of `forge.io.sinks` commits them; a function
  may instead override `open_sink` with its own `Sink`);
* its cost model (`cost_model`, for batching=memory), the layouts it can run exactly
  (`check_mode`), and what decides its results (`fingerprint`, for resume).

A worker is small on purpose (`run`, `close`) so a thread, a process or a Ray actor can
host it: the function object is pickled to a worker process, and a batch's output must
pickle (plain numpy arrays, not device tensors). The packer, scheduler, ledger and executors
see only items, batches and outputs: none of them knows which function runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from forge.batching.cost import CostModel
from forge.vocab.geometry import Batch, Device, Item
from forge.vocab.records import Rejected, ResultColumns, Skipped  # noqa: F401 (ResultColumns: the generic output)

if TYPE_CHECKING:
    from forge.io.results import ResultSchema
    from forge.io.store import RunStore


class BatchOutput(Protocol):
    prefix_computed_tokens: int  # prefix tokens run this step (0 on a prefix-cache hit)
    cache_hit: bool  # the prefix came from the device's cache


class Worker(Protocol):
    def run(self, batch: Batch) -> BatchOutput: ...

    def close(self) -> None: ...


class Sink(Protocol):
    def full(self) -> bool:
        """A shard's worth of rows (or bytes) is buffered: the loop flushes now."""

    def write(self, batch: Batch, output: BatchOutput, keep: list[bool] | None) -> None:
        """Buffer a batch's results; with `keep`, only the items where it is true (aligned
        with `batch.items`: the others were committed already)."""

    def flush(self) -> None:
        """Commit what is buffered as one shard (`RunStore.write_shard`); raise OSError on failure."""

    def close(self) -> dict[str, Any]:
        """Finish (nothing buffered is left); return figures for the report."""


class Function(ABC):
    name: str = ""
    #: dataclass of the root config keys this function reads, typed, with value checks from
    #: `forge.config.checks` (positive, one_of, ...) and the one home of their defaults: the config
    #: is validated against it before any work, and the function is built from an instance of it
    #: (its constructor's one argument). None: it reads no keys, and is built with none.
    config_schema: type | None = None
    #: causal decoders may reuse a prefix's KV; encoders must not
    causal: bool = True
    #: its workers run tree batches (`Batch.tree`: many prefix groups in packed rows), so the
    #: token packer may merge small prefix groups (`batching.merge_groups`); off unless declared
    tree_rows: bool = False
    #: False: its workers lay out a batch themselves (generate's decoder shares prefixes within it),
    #: so the packer cuts batches of whole sequences across prefixes instead of one group per prefix
    prefix_groups: bool = True

    @abstractmethod
    def records(self) -> Iterator[Item | Rejected | Skipped]:
        """Read and tokenize the input: one Item per good record, one Rejected per bad one (a Skipped
        per row the function passes over)."""

    @abstractmethod
    def open_worker(self, device: Device, cache_tokens: int) -> Worker:
        """Load the model on `device` (once) and return a worker for its batches."""

    def result_schema(self) -> ResultSchema:
        """What each item yields (`forge.io.results.ResultSchema`: fields, format, folder). The
        worker's outputs then carry `columns` (`ResultColumns`) with those fields."""
        from forge.errors import ForgeError

        raise ForgeError(
            f"function {self.name or type(self).__name__} declares no result_schema(); its author "
            "must declare one, or override open_sink() with a sink of its own"
        )

    def open_sink(self, store: RunStore) -> Sink:
        """The sink committing results: by default the generic one for `result_schema()`."""
        from forge.io.sinks import open_sink

        return open_sink(store, self.result_schema())

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides results (model identity, input content, options): a resume
        whose fingerprint differs is refused, naming what changed."""

    def output_bytes(self, items: int, own_tokens: int) -> dict[str, int | None] | None:
        """Bytes each result field holds for `items` committed items with `own_tokens` tokens
        after their prefixes (`forge plan`, the disk check); None: not known."""
        return None

    def sample_output(
        self, rows: int, max_seq_len: int | None = None, too_long: str = "skip"
    ) -> tuple[int, int, int] | None:
        """(items, own tokens, rows read) of the first `rows` input rows, for the disk check's
        estimate, each item counted as admission takes it (over `max_seq_len`: nothing unless
        `too_long` is truncate, then its first max_seq_len tokens); None: the function cannot say."""
        return None

    def worker_modules(self) -> list[str]:
        """Modules a worker process imports (preloaded once, so a replacement starts fast)."""
        return [type(self).__module__]

    def cost_model(self) -> CostModel | None:
        """Bytes per step from the model's shape (for batching=memory); no weights loaded."""
        return None

    def batch_device(self, device: Device) -> Device:
        """The device as the packer sees it for this function's batches, from what one of its steps
        takes (its limits under budget.tokens_per_step): itself for a forward pass; for a batch that
        runs many steps (generate's, whose sequences hold their KV while each step takes a token from
        each) larger limits, and the overhead of all its steps."""
        return device

    def step_bytes(self, device: Device) -> int:
        """Bytes one of its steps holds on `device` that `cost_model()` leaves out (0 for a forward
        pass, which it prices whole; generate's: one engine step's activations, which its KV model
        does not count): a device group's every stage keeps room for them (forge.runtime.placement.device_map)."""
        return 0

    def planned_peak_bytes(self, batch: Batch, device: Device, stored_prefix_tokens: int = 0) -> int | None:
        """For `forge plan`: the most device memory a worker may hold running `batch` on `device`
        (weights included), an upper bound, with `stored_prefix_tokens` of earlier batches'
        prefixes kept beside it; None where the function does not say (batching=memory's packer
        prices a forward pass's batches itself)."""
        return None

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = False) -> None:
        """Raise a one-line ForgeError, before any work, when this layout cannot give the results
        of one-item-at-a-time runs (say why, and which setting works). Default: every layout can."""

    def check_too_long(self, policy: str) -> None:
        """Raise a one-line ForgeError, before any work, when the run's `too_long` policy (skip,
        truncate or error) would change this function's results. Default: every policy is fine."""

    def describe(self) -> dict[str, Any]:
        """Paths used, for the report: at least `model` and `input` (and `path`: how it runs)."""
        return {}

    def expected_items(self) -> int | None:
        """How many records the input holds, if cheap to know (for the progress bar)."""
        return None

    def warnings(self) -> list[str]:
        """Warnings found while reading the input (each said once)."""
        return []
