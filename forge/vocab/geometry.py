"""Token geometry: the plain dataclasses that cross every seam in Forge.

Producers describe work as `Item`s (how many tokens, which shared prefix), consumers
declare `Limits` (four integers), and the packer turns items into `Batch`es. Nothing
here knows about models or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from forge.errors import ForgeError

NO_PREFIX = -1  # prefix code of an item without a shared prefix

#: `batching.window`'s default, defined here once: the most items the scheduler holds waiting
#: for a batch (its bounded look-ahead). The schema (forge.config.modes.Batching), the Scheduler
#: and RunSpec take it from here.
DEFAULT_WINDOW = 65536


@dataclass(frozen=True, slots=True)
class Limits:
    """What one consumer (a device worker) can take in one step."""

    max_batch_tokens: int  # padded token slots per step: rows x padded_len
    max_rows: int  # sequences-or-packed-rows per step
    max_seq_len: int  # longest sequence (prefix included) a row may hold
    pad_multiple: int = 1  # padded_len is rounded up to a multiple of this

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_rows", "max_seq_len", "pad_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ForgeError(f"limits.{name} must be a positive integer, got {value!r}")

        if self.max_batch_tokens < self.pad(self.max_seq_len):
            raise ForgeError(
                f"limits.max_batch_tokens={self.max_batch_tokens} is below max_seq_len={self.max_seq_len} "
                f"(padded to {self.pad(self.max_seq_len)}): a full-length row could never run; "
                "raise max_batch_tokens or lower max_seq_len"
            )

    def pad(self, n: int) -> int:
        """`n` rounded up to the pad multiple."""
        m = self.pad_multiple
        return -(-n // m) * m

    def capped(self, tokens_per_step: int | None) -> Limits:
        """These limits with max_batch_tokens capped by a function's step budget."""
        if tokens_per_step is None or tokens_per_step >= self.max_batch_tokens:
            return self
        return Limits(tokens_per_step, self.max_rows, self.max_seq_len, self.pad_multiple)

    def as_dict(self) -> dict[str, int]:
        return {
            "max_batch_tokens": self.max_batch_tokens,
            "max_rows": self.max_rows,
            "max_seq_len": self.max_seq_len,
            "pad_multiple": self.pad_multiple,
        }


@dataclass(slots=True)
class Item:
    """One unit of work, described by its token geometry."""

    id: str  # stable identity, reported on failure
    num_tokens: int  # whole sequence, shared prefix included
    prefix_key: str | None = None  # identity of the shared prefix; None when there is none
    prefix_len: int = 0  # tokens of the sequence that belong to the shared prefix
    tokens: Sequence[int] | np.ndarray | None = None  # the token ids (prefix first); None for geometry-only work
    meta: Any = None  # opaque to Forge: passed through to the function (label, row index, ...)
    index: int = -1  # position of its record in the input: the key output is committed under

    @property
    def suffix_len(self) -> int:
        return self.num_tokens - self.prefix_len


@dataclass(frozen=True, slots=True)
class StepTime:
    """A simulated device's time for one step, in seconds: a + b x tokens + c x scores.

    tokens: padded row slots plus prefix tokens computed in the step; scores: query x key
    pairs attention computes (rows x padded_len x (prefix + padded_len), plus the prefix's own
    pass on a cache miss). `forge calibrate` measures a, b and c on a real device.
    """

    seconds_per_step: float  # a: fixed cost of a step (launches, host work)
    seconds_per_slot: float  # b: per token slot computed
    seconds_per_score: float = 0.0  # c: per attention query x key pair

    def __post_init__(self) -> None:
        for name in ("seconds_per_step", "seconds_per_slot", "seconds_per_score"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ForgeError(f"sim.{name} must be a finite number >= 0, got {value!r}")
        if self.seconds_per_slot <= 0:
            raise ForgeError("sim.seconds_per_slot must be > 0: a step over more tokens takes longer")

    def seconds(self, tokens: int, scores: int) -> float:
        return self.seconds_per_step + self.seconds_per_slot * tokens + self.seconds_per_score * scores

    @property
    def overhead_tokens(self) -> int:
        """a / b: the slots one step's fixed cost is worth (what batch_overhead_tokens means)."""
        return int(round(self.seconds_per_step / self.seconds_per_slot))


@dataclass(frozen=True, slots=True)
class StepBudget:
    """The step budget (`budget.tokens_per_step`): the most token slots one forward step on a device
    carries. A function whose batch is one forward pass has its batches capped by it
    (`Limits.capped`). An engine that runs a batch in steps of its own (`engine`: generate's decoder,
    whose batch holds several steps' tokens of KV) keeps each step within it and reports the steps it
    ran (`forge.vocab.records.ResultColumns.steps`). The ledger holds every step a device ran to it."""

    tokens: int  # token slots one step carries at most
    engine: bool = False  # the function's engine runs a batch in steps of its own (else one pass a batch)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise ForgeError(f"budget.tokens_per_step must be a positive integer, got {self.tokens!r}")

    def over(self, steps: Sequence[int]) -> list[int]:
        """The steps (their token slots) that carried more than the budget: none, in a sound run."""
        return [s for s in steps if s > self.tokens]


@dataclass(frozen=True, slots=True)
class Member:
    """One device of a device group: where its stage's layers live, and its byte budget."""

    torch_device: str  # "cuda:0", "cpu"; "disk" only as an offload target
    memory_bytes: int | None  # the budget of this member's stage (weights + activations); None: unknown
    sim: StepTime | None = None  # a simulated member: its step time for the WHOLE model (a stage runs its share)


@dataclass(frozen=True, slots=True)
class Device:
    """A consumer of batches: a name, what backs it, and its limits. A device group (`group`
    non-empty) is one consumer whose model is split in contiguous stages over its members
    (`forge.runtime.placement.device_map`); its limits and memory_bytes are those of its tightest stage."""

    name: str  # unique, e.g. "cuda:0" or "cpu"
    limits: Limits
    torch_device: str = "cpu"  # where the worker puts its model ("cpu", "cuda:1", ...)
    memory_bytes: int | None = None  # byte budget for batching=memory; None: unknown
    batch_overhead_tokens: int | None = None  # per-step cost in token slots; None: the mode's default
    sim: StepTime | None = None  # a simulated device (forge plan only): its step time; None: a real one
    group: tuple[Member, ...] = ()  # a device group's members, in stage order; empty: a single device
    offload: str | None = None  # a group's offload target where its members cannot hold the model: cpu | disk | None
    link_gb_per_s: float = 16.0  # a group: bandwidth between stages (and to CPU offload), GB/s, for the step cost
    #: the step budget on this device (`budget.tokens_per_step`, set when the run is built); None: a
    #: device made by hand, whose batch is one forward pass within `limits.max_batch_tokens`
    step_budget: StepBudget | None = None

    def steps(self) -> StepBudget:
        """Its step budget: `step_budget`, else a batch is one step of at most `limits.max_batch_tokens`."""
        return self.step_budget or StepBudget(self.limits.max_batch_tokens)

    def with_step_budget(self, tokens_per_step: int | None) -> Device:
        """This device under `budget.tokens_per_step` (None: none beyond its limits): a batch, one step,
        of at most that many token slots (`Limits.capped`), and the step budget that says so."""
        limits = self.limits.capped(tokens_per_step)
        return replace(self, limits=limits, step_budget=StepBudget(limits.max_batch_tokens))


@dataclass(frozen=True, slots=True)
class Batch:
    """What one device runs in one step. Immutable: the scheduler passes a changed batch on
    (`dataclasses.replace`), never edits one it handed out.

    Rows are lists of items. A row holds one item (row per sequence) or several items
    end to end (packed rows). When `split_prefix` is true every item shares `prefix_key`,
    rows hold only the items' suffixes, and the prefix runs once for the whole batch
    (or comes from the device's prefix cache). When `tree` is true (packed, not split) a row
    holds prefix groups: each run of items sharing a prefix key puts that prefix in the row
    once, then the items' suffixes after it (`row_used`), so one batch carries many prefixes.
    """

    rows: list[list[Item]]
    padded_len: int  # every row is padded to this many token slots
    prefix_key: str | None = None  # shared by every item when set
    prefix_len: int = 0  # length of that shared prefix
    split_prefix: bool = False  # rows hold suffixes; the prefix runs once (or is cached)
    packed: bool = False  # rows may hold several sequences end to end
    tree: bool = False  # packed rows of prefix groups: each group's prefix once, then its suffixes
    seq: int = -1  # order in which the scheduler cut it
    retry: bool = False  # re-run of items from a failed batch
    cache_hit: bool | None = field(default=None, compare=False)  # scheduler's prediction

    @property
    def items(self) -> list[Item]:
        return [item for row in self.rows for item in row]

    def select(self, keep) -> Batch:
        """This batch with only the items where `keep` (aligned with `items`) is true."""
        flags = iter(keep)
        rows = [kept for row in self.rows if (kept := [it for it in row if next(flags)])]
        return replace(self, rows=rows)

    def halves(self) -> list[Batch]:
        """Two batches holding this one's items (rows split in two; a single packed row
        split between its items), for a retry after a failure; one item gives itself."""
        if len(self.rows) > 1:
            mid = len(self.rows) // 2
            return [replace(self, rows=self.rows[:mid], retry=True), replace(self, rows=self.rows[mid:], retry=True)]
        row = self.rows[0]
        if len(row) == 1:
            return [replace(self, retry=True)]
        mid = len(row) // 2
        return [replace(self, rows=[row[:mid]], retry=True), replace(self, rows=[row[mid:]], retry=True)]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def row_offset(self) -> int:
        """Tokens of each item that sit outside the rows (the split prefix)."""
        return self.prefix_len if self.split_prefix else 0

    @property
    def row_tokens(self) -> int:
        """Useful tokens inside the rows."""
        off = self.row_offset
        return sum(row_used(row, off, self.tree) for row in self.rows)

    @property
    def num_tokens(self) -> int:
        """Useful tokens of every item, prefix included."""
        return sum(it.num_tokens for row in self.rows for it in row)

    @property
    def padded_slots(self) -> int:
        return len(self.rows) * self.padded_len

    @property
    def padding(self) -> int:
        return self.padded_slots - self.row_tokens

    @property
    def prefix_tokens(self) -> int:
        """Prefix tokens the items need (each item needs its whole prefix)."""
        return sum(it.prefix_len for row in self.rows for it in row)


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one step of a batch computes: the one formula the scheduler's balancing, the
    simulated executor and the memory model share."""

    tokens: int  # token slots computed: the padded rows plus the prefix tokens computed
    scores: int  # attention query x key pairs: rows x padded_len x (prefix + padded_len), plus the prefix's own pass
    prefix_computed: int  # prefix tokens computed: the split prefix on a cache miss, else 0


def row_used(row: Sequence[Item], offset: int = 0, tree: bool = False) -> int:
    """Tokens a row's items take in it: each item's tokens past `offset` (the split prefix); in a
    tree row, each run of items sharing a prefix key takes that prefix once, then their suffixes."""
    if not tree:
        return sum(it.num_tokens - offset for it in row)
    used, last = 0, None
    for it in row:
        key = it.prefix_key if it.prefix_len else None
        if key is None or key != last:
            used += it.prefix_len
        used += it.num_tokens - it.prefix_len
        last = key
    return used


def row_scores(padded_len: int, context: int) -> int:
    """Attention query x key pairs of one row of `padded_len` slots behind `context` prefix tokens."""
    return padded_len * (context + padded_len)


def step_cost(batch: Batch, cache_hit: bool | None = None) -> StepCost:
    """What `batch` computes in one step; its prefix is computed unless the device's cache holds
    it (`cache_hit`; None: the scheduler's prediction on the batch)."""
    hit = batch.cache_hit if cache_hit is None else cache_hit
    context = batch.prefix_len if batch.split_prefix else 0
    computed = 0 if hit else context
    scores = batch.num_rows * row_scores(batch.padded_len, context) + computed * computed
    return StepCost(batch.padded_slots + computed, scores, computed)


def broken_limit(batch: Batch, limits: Limits) -> str | None:
    """Which limit the batch breaks, or None. Used by tests and as a guard."""
    if batch.num_rows > limits.max_rows:
        return "max_rows"
    if batch.padded_slots > limits.max_batch_tokens:
        return "max_batch_tokens"
    if batch.padded_len % limits.pad_multiple:
        return "pad_multiple"
    off = batch.row_offset
    for row in batch.rows:
        used = row_used(row, off, batch.tree)
        if used > batch.padded_len:
            return "padded_len"
        if off + used > limits.max_seq_len:  # a row's tokens (and its prefix) fit one sequence
            return "max_seq_len"
        if any(it.num_tokens > limits.max_seq_len for it in row):
            return "max_seq_len"
    return None


def pad_to_limits(batch: Batch, limits: Limits) -> Batch | None:
    """`batch` padded to its longest row for `limits`, or None when it breaks one of them."""
    off = batch.row_offset
    used = max(row_used(row, off, batch.tree) for row in batch.rows)
    fitted = replace(batch, padded_len=limits.pad(used))
    return fitted if broken_limit(fitted, limits) is None else None
