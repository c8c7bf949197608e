"""The packer seam: a window of waiting items and a policy that cuts batches from it.

A packer is pure Python/numpy and knows only token geometry: items (lengths, prefix keys)
and a device's four limits. The scheduler owns routing; the packer owns cutting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, NamedTuple

from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


class GroupInfo(NamedTuple):
    """What waits under one group key (a prefix key, or None). A tuple: built per request."""

    key: str | None  # prefix key shared by the group's items; None for mixed/no prefix
    items: int  # waiting items
    tokens: int  # waiting row tokens: what the group would occupy in rows
    prefix_len: int  # the shared prefix length (0 when key is None)
    cacheable: bool  # batches cut from it run their prefix once, so a device cache can serve it


class Packer(ABC):
    """Holds admitted items and cuts batches for a device on request.

    `add`/`add_many` admit items; `groups` says what waits; `cut(key, device, drain)` removes and
    returns the next batch of group `key` for `device` (None when the group should wait for
    more items, which only happens when `drain` is false).
    """

    #: name of the batching mode, set by the factory
    mode: str = ""

    @abstractmethod
    def add(self, item: Item) -> None: ...

    def add_many(self, items: Iterable[Item]) -> None:
        """Admit items in order. Packers override this when one loop beats many calls."""
        for item in items:
            self.add(item)

    @abstractmethod
    def groups(self) -> list[GroupInfo]: ...

    @abstractmethod
    def cut(self, key: str | None, device: Device, drain: bool) -> Batch | None: ...

    @abstractmethod
    def __len__(self) -> int:
        """Items waiting in the window."""

    def check_device(self, device: Device) -> None:
        """Raise ForgeError if this mode cannot serve `device` (checked before any work)."""

    def overhead_tokens(self, device: Device) -> int:
        """Per-step cost in token slots used when weighing batch size against padding."""
        if device.batch_overhead_tokens is not None:
            return device.batch_overhead_tokens
        return getattr(self, "batch_overhead_tokens", 0)


PackerFactory = Callable[..., Packer]


def create_packer(modes: dict[str, PackerFactory], mode: str, options: dict) -> Packer:
    """Build the packer for `mode` from the registered modes, with a clear error for bad names."""
    if mode not in modes:
        raise ForgeError(f"unknown batching mode {mode!r}; choose one of: {', '.join(sorted(modes))}")
    try:
        packer = modes[mode](**options)
    except TypeError as exc:
        raise ForgeError(f"batching={mode}: bad option ({exc}); see conf/batching/{mode}.yaml") from None
    packer.mode = mode
    return packer
