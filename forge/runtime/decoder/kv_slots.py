"""The KV cache of a decoding batch: one slot per running sequence, in preallocated buffers.

Model: every layer's keys and values live in one buffer ``[slots, kv heads, columns, head dim]``
that transformers' attention reads through a cache layer (`SlotLayer`, a `DynamicLayer` whose
`update` writes into the buffer instead of concatenating: a step costs its new column, not a copy
of the whole cache). All slots share the column of their next token, so a sequence sits
right-aligned: its tokens are contiguous and end at the current column, the columns before them
are masked out (``mask`` 0) and hold zeros or an earlier sequence's finite values, which a masked
softmax weighs by exactly 0. Within a row, column distance is token distance: causal and
sliding-window masks built on columns are the sequence's own. Position ids are passed per slot.

`SlotKV` places a prefilled block's KV into free slots (shifting every slot right when the block
is wider than the columns so far), frees slots, and drops columns no live slot uses any more and
slots that are free (`tidy`): with growth, the only whole-buffer copies, amortised.

Bytes: a slot's column over every layer costs `column_bytes`; the buffers hold slots x capacity
of them. Under a byte `limit` (set by the decoder before each growth: its KV budget less what it
holds `beside`) growth takes the capacity that fits with the copy's transient, and `peak_bytes`
records the most held at once: old and new buffers during a copy, and what is beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer; `used` columns hold data."""

    def __init__(self) -> None:
        super().__init__()
        self.used = 0
        self.k_buf = torch.empty(0)  # [slots, kv heads, capacity, dim], shaped by SlotKV.place
        self.v_buf = torch.empty(0)
        self.shaped = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a slot layer is filled by SlotKV.place, before the first decoding step")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        n, q = self.used, key_states.shape[-2]
        self.k_buf[:, :, n : n + q] = key_states
        self.v_buf[:, :, n : n + q] = value_states
        self.used = n + q
        self.keys, self.values = self.k_buf[:, :, : n + q], self.v_buf[:, :, : n + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.used

    def view(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.used], self.v_buf[:, :, : self.used]


class SlotKV:
    """Slots of running sequences over every layer's `SlotLayer`, with their mask and next positions."""

    def __init__(self, num_layers: int, device: Any):
        self.layers = [SlotLayer() for _ in range(num_layers)]
        self.cache = Cache(layers=list[Any](self.layers))
        self.device = device
        self.columns = 0  # columns in use: every live sequence ends at columns - 1
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [slots, capacity]
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # each slot's next position
        self.free: list[int] = []  # slots without a sequence
        self.slots = 0
        self.reserved = (0, 0)  # (slots, columns) the first buffers hold at least
        self.column_bytes = 0  # one slot's column of keys and values over every layer (known at the first place)
        self.limit: int | None = None  # bytes the buffers may hold, copies included (None: no limit)
        self.beside = 0  # bytes the owner holds beside the buffers (counted in peak_bytes)
        self.peak_bytes = 0  # the most the buffers and what is beside them held at once, during a copy included

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def held_bytes(self, slots: int | None = None, capacity: int | None = None) -> int:
        """The buffers' bytes (or those of `slots` x `capacity` columns)."""
        slots = self.slots if slots is None else slots
        return slots * (self.capacity if capacity is None else capacity) * self.column_bytes

    def usable(self, limit: int) -> int:
        """The most the buffers may hold under `limit`: a copy adds at most two buffers of one layer
        (`_replace`), so the buffers stay within L / (L + 1) of it."""
        layers = len(self.layers)
        return limit * layers // (layers + 1)

    def _grown(self, need: int, slots: int, at_least: int = 0) -> int:
        """The capacity to grow to for `need` columns over `slots` slots: half as much again (amortised
        copies), less where the byte limit allows less; never under `need`."""
        want = max(need, at_least, self.capacity * 3 // 2 + 16)
        if self.limit is not None and self.column_bytes and slots:
            want = max(need, min(want, self.usable(self.limit) // (slots * self.column_bytes)))
        return want

    def grow_fits(self, limit: int) -> bool:
        """Whether the buffers, with the next step's column, stay within `usable(limit)`."""
        capacity = max(self.capacity, self.columns + 1)
        return self.held_bytes(capacity=capacity) <= self.usable(limit)

    def place_fits(self, rows: int, width: int, limit: int) -> bool:
        """Whether the buffers, once a block of `rows` x `width` is placed, stay within `usable(limit)`."""
        slots, capacity, _ = self._placement(rows, width)
        return self.held_bytes(slots, capacity) <= self.usable(limit)

    def _placement(self, rows: int, width: int) -> tuple[int, int, int]:
        """(slots, capacity, shift) of the buffers once a block of `rows` x `width` is placed."""
        shift = max(0, width - self.columns)
        need = self.columns + shift + 1
        if len(self.free) >= rows and not shift and need <= self.capacity:
            return self.slots, self.capacity, 0
        slots = max(self.slots + rows - len(self.free), self.slots, self.reserved[0])
        capacity = self.capacity if need <= self.capacity else self._grown(need, slots, self.reserved[1])
        return slots, capacity, shift

    def _resize(self, slots: int, capacity: int, shift: int = 0, new_rows_written: bool = False) -> None:
        """New buffers of `slots` x `capacity` columns, the old data moved `shift` columns right.
        Columns past the data are left unwritten: no view reads them before a step writes them; nor
        are new slots' columns when the caller writes them all (`new_rows_written`)."""
        n = self.columns

        def fill(old: torch.Tensor, new: torch.Tensor) -> None:
            new[: old.shape[0], :, shift : shift + n] = old[:, :, :n]
            new[: old.shape[0], :, :shift] = 0  # masked, but read: finite
            if not new_rows_written:
                new[old.shape[0] :, :, : shift + n] = 0

        self._replace(slots, capacity, fill)
        mask = self.mask.new_zeros(slots, capacity)
        mask[: self.slots, shift : shift + n] = self.mask[:, :n]
        positions = self.positions.new_zeros(slots)
        positions[: self.slots] = self.positions
        self.mask, self.positions = mask, positions
        self.free += range(self.slots, slots)
        self.slots, self.columns = slots, n + shift
        self._sync()

    def _replace(self, slots: int, capacity: int, fill: Callable[[torch.Tensor, torch.Tensor], None], gathered=False):
        """Each layer's key and value buffer in turn replaced by a new one of `slots` x `capacity` that
        `fill(old, new)` fills; the old one is let go before the next is made, so a copy holds the
        larger of the old and new buffers plus one buffer (two when `fill` gathers rows through a
        temporary), not both sets: what `peak_bytes` records."""
        held = self.held_bytes()
        for layer in self.layers:
            layer.keys = layer.values = None  # views of the old buffers: let them go
            for name in ("k_buf", "v_buf"):
                old = getattr(layer, name)
                new = old.new_empty(slots, old.shape[1], capacity, old.shape[3])
                size = new.numel() * new.element_size()
                self.peak_bytes = max(self.peak_bytes, self.beside + held + size * (2 if gathered else 1))
                fill(old, new)
                setattr(layer, name, new)
                held += size - old.numel() * old.element_size()
                del old, new

    def _sync(self) -> None:
        for layer in self.layers:
            layer.used = self.columns
            layer.view()

    def reserve(self, slots: int, columns: int) -> None:
        """The least the first buffers hold: the sequences that can run at once, their longest span."""
        self.reserved = (slots, columns)

    def place(self, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, positions: torch.Tensor):
        """Put a block of sequences in free slots, right-aligned at the current column: per layer
        their keys and values ``[rows, heads, width, dim]``, left-padded as `mask` ``[rows, width]``
        says; `positions`: each one's next position. Returns their slots, in order."""
        rows, width = mask.shape
        if not self.layers[0].shaped:
            self.shape_like(kv)
        slots, capacity, shift = self._placement(rows, width)
        if (slots, capacity) != (self.slots, self.capacity) or shift:
            # the block fills every new slot's columns: it is as wide as the columns and takes them all
            written = self.columns + shift == width and rows >= len(self.free) + slots - self.slots
            self._resize(slots, capacity, shift, written)
        taken, self.free = self.free[:rows], self.free[rows:]
        index = torch.tensor(taken, dtype=torch.long)  # on the CPU: it indexes buffers on every layer's device
        n = self.columns
        for layer, (k, v) in zip(self.layers, kv):
            layer.k_buf[index, :, n - width : n] = k
            layer.v_buf[index, :, n - width : n] = v
        self.mask[index] = 0
        self.mask[index, n - width : n] = mask.to(self.mask.dtype)
        self.positions[index] = positions
        return taken

    def shape_like(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Empty buffers of the heads, head sizes and dtype of `kv` (a block's or a probe's, per layer)."""
        for layer, (k, v) in zip(self.layers, kv):
            layer.k_buf = k.new_zeros(0, k.shape[1], 0, k.shape[3])
            layer.v_buf = v.new_zeros(0, v.shape[1], 0, v.shape[3])
            layer.shaped = True
        self.column_bytes = sum(
            (layer.k_buf.shape[1] * layer.k_buf.shape[3] + layer.v_buf.shape[1] * layer.v_buf.shape[3])
            * layer.k_buf.element_size()
            for layer in self.layers
        )

    def release(self, slot: int) -> None:
        self.mask[slot] = 0
        self.free.append(slot)

    def before_step(self) -> None:
        """Room for one more column, every slot's next column unmasked (a free slot attends to it
        alone: no row of the step is fully masked)."""
        if self.columns + 1 > self.capacity:
            self._resize(self.slots, self._grown(self.columns + 1, self.slots))
        self.mask[:, self.columns] = 1

    def after_step(self) -> None:
        self.columns += 1
        self.positions += 1
        for slot in self.free:
            self.mask[slot] = 0

    def step_mask(self) -> torch.Tensor:
        return self.mask[:, : self.columns + 1]

    def tidy(self, force: bool = False) -> dict[int, int] | None:
        """Drop free slots once they are a quarter of the slots, and leading columns no live slot uses
        once they are a quarter of the columns (`force`: any): a copy of the buffers (about one step's
        reads of them) for every later step's quarter (the live slots keep their order).
        Returns each kept slot's new number, or None when nothing moved."""
        free = set(self.free)
        used = self.mask[:, : self.columns].any(0).nonzero()
        lead = int(used[0]) if len(used) else self.columns
        drop_slots = bool(free) and (force or len(free) * 4 >= self.slots)
        drop_columns = lead > 0 and (force or lead * 4 >= self.columns)
        if not (drop_slots or drop_columns):
            return None
        keep = [s for s in range(self.slots) if not (drop_slots and s in free)]
        n, cut = self.columns, lead if drop_columns else 0
        index = torch.tensor(keep, dtype=torch.long)  # on the CPU: it indexes buffers on every layer's device

        def fill(old: torch.Tensor, new: torch.Tensor) -> None:
            new[:, :, : n - cut] = old[index, :, cut:n]

        self._replace(len(keep), self.capacity, fill, gathered=True)
        mask = self.mask.new_zeros(len(keep), self.capacity)
        mask[:, : n - cut] = self.mask[index, cut:n]
        self.mask = mask
        self.positions = self.positions[index].clone()
        self.free = [k for k, s in enumerate(keep) if s in free]
        self.slots, self.columns = len(keep), n - cut
        self._sync()
        return {s: k for k, s in enumerate(keep)}
