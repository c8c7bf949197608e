"""The packer seam: a window of waiting item geometry and a policy that cuts batches from it.

A packer is pure Python/numpy and knows only token geometry: columns of item lengths and
prefix codes (`Chunk`) and a device's four limits. It names items by id and hands back
`Cut`s; the scheduler owns the items themselves, and routing. No per-item Python objects
cross this seam, so a million items pack in well under a second.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

from forge.config.modes import Batching
from forge.errors import ForgeError
from forge.vocab.geometry import Batch, Device, Item

if TYPE_CHECKING:
    from forge.batching.cost import CostModel


@dataclass(frozen=True, slots=True)
class Chunk:
    """Geometry of admitted items as columns, one entry per item (all int64 arrays)."""

    ids: np.ndarray  # the item's handle: unique among waiting items; cuts name items by it
    num_tokens: np.ndarray  # whole sequence, shared prefix included
    prefix: np.ndarray  # code of the shared prefix; NO_PREFIX when the item has none
    prefix_len: np.ndarray  # tokens of the shared prefix; one value per code, 0 for NO_PREFIX

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class Cut:
    """One batch as the packer cuts it: which items, how they sit in rows, how rows pad.
    Immutable: the scheduler hands on a copy with its `seq` and `cache_hit` (`dataclasses.replace`)."""

    ids: np.ndarray  # ids of the batch's items, row by row
    lengths: np.ndarray  # each item's tokens inside its row, aligned with `ids`
    row_ends: list[int] | None  # packed: end of each row in `ids`; None: one item per row
    padded_len: int  # every row is padded to this many token slots
    row_tokens: int  # useful tokens inside the rows: sum(lengths)
    prefix: int  # shared prefix code of every item, or NO_PREFIX (rows of whole sequences)
    split_prefix: bool  # rows hold suffixes; the prefix runs once for the batch (or is cached)
    packed: bool = False  # rows may hold several items end to end
    tree: bool = False  # packed rows of prefix groups (`Batch.tree`): items of many prefix codes
    seq: int = -1  # order in which the scheduler handed it out
    cache_hit: bool | None = None  # scheduler's prediction: the device's cache holds the prefix

    @property
    def num_rows(self) -> int:
        return len(self.ids) if self.row_ends is None else len(self.row_ends)

    @property
    def padded_slots(self) -> int:
        return self.num_rows * self.padded_len


@runtime_checkable
class Feed(Protocol):
    """Where the scheduler's window gets its items: what `Scheduler` takes besides Items
    (`forge.core.columns`: `ItemFeed`, `GeometryFeed`, `ColumnFeed`)."""

    def admit(self, n: int) -> Chunk:
        """The geometry of up to `n` more items (fewer: the input is exhausted)."""

    def key(self, code: int) -> str | None:
        """The prefix key of a prefix code (None for NO_PREFIX)."""

    def prefix_len(self, code: int) -> int:
        """The length of a prefix code's prefix (0 for NO_PREFIX)."""

    def code(self, key: str | None) -> int:
        """The prefix code of a prefix key (NO_PREFIX for None)."""

    def batch(self, cut: Cut) -> Batch:
        """The batch a cut names, its items out of the feed."""

    def waiting(self) -> list[Item]:
        """Every item admitted and not yet in a batch, as Items (to account for them when a run stops)."""

    def close(self) -> None:
        """The run is over: stop reading the input (a reading thread, open files)."""


class Urgency(IntEnum):
    """How much the scheduler needs a batch now; `Packer.cut` cuts more the higher it is."""

    WAIT = 0  # the window is filling: hand out only what is ready (cut already, or a full batch)
    ROOM = 1  # the window is full: plan from what it holds; what more company would clearly
    #           improve (a sparse long tail, a packed group's last batch) still waits
    DRAIN = 2  # no more items will come, or nothing else is left: cut everything


class GroupInfo(NamedTuple):
    """What waits under one group (a prefix code, or NO_PREFIX). A tuple, rebuilt when the group changes."""

    key: int  # prefix code shared by the group's items; NO_PREFIX for mixed/no prefix
    items: int  # waiting items
    tokens: int  # waiting row tokens: what the group would occupy in rows
    cacheable: bool  # batches cut from it run their prefix once, so a device cache can serve it
    ready: int  # batches it can hand out under Urgency.WAIT (cut already, or full)
    new_tokens: int  # row tokens that arrived since its batches were last planned (all, if never)


class Packer(ABC):
    """Holds admitted geometry and cuts batches for a device on request.

    `add` admits a chunk; `groups` says what waits; `cut(key, device, urgency)` removes and
    returns the next batch of group `key` for `device`, or None when the group should wait
    for more items (never under `Urgency.DRAIN` while the group holds anything that fits).
    A packer is built from its mode's typed config, an instance of `config_schema`.
    """

    #: the mode's schema (`forge.config.modes`): its keys, their types and defaults; the config
    #: of a run is checked against it, and the packer is built from an instance of it
    config_schema: ClassVar[type[Batching]] = Batching
    #: name of the batching mode, set by the factory
    mode: str = ""
    #: whether batches split the shared prefix off their rows (it runs once, or from cache)
    split_prefix: bool = False
    #: "rows" (one sequence per row) or "packed" (several sequences end to end per row)
    packing: str = "rows"
    #: whether small prefix groups may share tree batches (`Batch.tree`); the run turns it off
    #: where the function or its model cannot run them exactly
    merge_groups: bool = False
    #: per-step cost in token slots, for devices that declare none (`overhead_tokens`)
    batch_overhead_tokens: int = 0
    #: the memory model the packer bounds batches with; None: it bounds none by memory
    cost_model: CostModel | None = None

    @abstractmethod
    def add(self, chunk: Chunk) -> None: ...

    @abstractmethod
    def groups(self) -> list[GroupInfo]: ...

    @abstractmethod
    def cut(self, key: int, device: Device, urgency: Urgency) -> Cut | None: ...

    def first_cut(self, keys: Iterable[int], device: Device, urgency: Urgency) -> Cut | None:
        """`cut` on each of `keys` in turn: the first batch cut, or None. A packer may answer
        the whole walk in one call."""
        for key in keys:
            cut = self.cut(key, device, urgency)
            if cut is not None:
                return cut
        return None

    @abstractmethod
    def __len__(self) -> int:
        """Items waiting in the window."""

    def fits(self, num_tokens: np.ndarray, prefix_len: np.ndarray, device: Device) -> np.ndarray:
        """Per item (columns), whether a batch of it alone fits `device`: admission fails
        items that fit no device, so nothing waits for ever."""
        return num_tokens <= device.limits.max_seq_len

    def batch_fits(self, rows: int, padded_len: int, prefix_len: int, device: Device) -> bool:
        """Whether a batch of this shape (rows of `padded_len` slots behind a split prefix of
        `prefix_len` tokens) may run on `device` beyond its four limits (memory mode: its
        predicted peak within the budget). Checked before a batch that came back is re-routed."""
        return True

    def check_device(self, device: Device) -> None:
        """Raise ForgeError if this mode cannot serve `device` (checked before any work)."""

    def overhead_tokens(self, device: Device) -> int:
        """Per-step cost in token slots used when weighing batch size against padding."""
        if device.batch_overhead_tokens is not None:
            return device.batch_overhead_tokens
        return self.batch_overhead_tokens

    def budget(self, device: Device) -> int | None:
        """`device`'s memory budget in bytes as this packer bounds batches by it; None: no bound."""
        return None

    def predicted_bytes(self, batch: Batch) -> int | None:
        """`batch`'s predicted peak bytes on a device; None when this packer has no memory model."""
        return None


PackerFactory = Callable[..., Packer]


def create_packer(modes: dict[str, PackerFactory], mode: str, options: dict[str, Any]) -> Packer:
    """Build the packer for `mode` from the registered modes: its factory gets an instance of its
    `config_schema` made from `options` (the mode's keys), and any other option by keyword (the
    run adds `cost_model` for a factory that takes one). A clear error for bad names."""
    if mode not in modes:
        raise ForgeError(f"unknown batching mode {mode!r}; choose one of: {', '.join(sorted(modes))}")
    factory = modes[mode]
    schema = getattr(factory, "config_schema", Batching)
    keys = {f.name for f in dataclasses.fields(schema)}
    try:
        config = schema(**{k: v for k, v in options.items() if k in keys})
        packer = factory(config, **{k: v for k, v in options.items() if k not in keys})
    except TypeError as exc:
        raise ForgeError(f"batching={mode}: bad option ({exc}); see conf/batching/{mode}.yaml") from None
    packer.mode = mode
    return packer
