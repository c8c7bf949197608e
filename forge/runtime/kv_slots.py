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
"""

from __future__ import annotations

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

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def _resize(self, slots: int, capacity: int, shift: int = 0, new_rows_written: bool = False) -> None:
        """New buffers of `slots` x `capacity` columns, the old data moved `shift` columns right.
        Columns past the data are left unwritten: no view reads them before a step writes them; nor
        are new slots' columns when the caller writes them all (`new_rows_written`)."""
        n = self.columns
        for layer in self.layers:
            for name in ("k_buf", "v_buf"):
                old = getattr(layer, name)
                new = old.new_empty(slots, old.shape[1], capacity, old.shape[3])
                new[: old.shape[0], :, shift : shift + n] = old[:, :, :n]
                new[: old.shape[0], :, :shift] = 0  # masked, but read: finite
                if not new_rows_written:
                    new[old.shape[0] :, :, : shift + n] = 0
                setattr(layer, name, new)
        mask = self.mask.new_zeros(slots, capacity)
        mask[: self.slots, shift : shift + n] = self.mask[:, :n]
        positions = self.positions.new_zeros(slots)
        positions[: self.slots] = self.positions
        self.mask, self.positions = mask, positions
        self.free += range(self.slots, slots)
        self.slots, self.columns = slots, n + shift
        self._sync()

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
            for layer, (k, v) in zip(self.layers, kv):
                layer.k_buf = k.new_zeros(0, k.shape[1], 0, k.shape[3])
                layer.v_buf = v.new_zeros(0, v.shape[1], 0, v.shape[3])
                layer.shaped = True
        shift = max(0, width - self.columns)
        need = self.columns + shift + 1
        if len(self.free) < rows or shift or need > self.capacity:
            slots = max(self.slots + rows - len(self.free), self.slots, self.reserved[0])
            capacity = self.capacity
            if need > capacity:
                capacity = max(need, self.reserved[1], capacity * 3 // 2 + 16)
            # the block fills every new slot's columns: it is as wide as the columns and takes them all
            written = self.columns + shift == width and rows >= len(self.free) + slots - self.slots
            self._resize(slots, capacity, shift, written)
        taken, self.free = self.free[:rows], self.free[rows:]
        index = torch.tensor(taken, dtype=torch.long, device=self.device)
        n = self.columns
        for layer, (k, v) in zip(self.layers, kv):
            layer.k_buf[index, :, n - width : n] = k
            layer.v_buf[index, :, n - width : n] = v
        self.mask[index] = 0
        self.mask[index, n - width : n] = mask.to(self.mask.dtype)
        self.positions[index] = positions
        return taken

    def release(self, slot: int) -> None:
        self.mask[slot] = 0
        self.free.append(slot)

    def before_step(self) -> None:
        """Room for one more column, every slot's next column unmasked (a free slot attends to it
        alone: no row of the step is fully masked)."""
        if self.columns + 1 > self.capacity:
            self._resize(self.slots, self.capacity * 3 // 2 + 16)
        self.mask[:, self.columns] = 1

    def after_step(self) -> None:
        self.columns += 1
        self.positions += 1
        for slot in self.free:
            self.mask[slot] = 0

    def step_mask(self) -> torch.Tensor:
        return self.mask[:, : self.columns + 1]

    def live(self) -> int:
        return self.slots - len(self.free)

    def tidy(self) -> dict[int, int] | None:
        """Drop free slots once they are a quarter of the slots, and leading columns no live slot uses
        once they are a quarter of the columns: a copy of the buffers (about one step's reads of them)
        for every later step's quarter (the live slots keep their order).
        Returns each kept slot's new number, or None when nothing moved."""
        free = set(self.free)
        used = self.mask[:, : self.columns].any(0).nonzero()
        lead = int(used[0]) if len(used) else self.columns
        drop_slots = bool(free) and len(free) * 4 >= self.slots
        drop_columns = lead > 0 and lead * 4 >= self.columns
        if not (drop_slots or drop_columns):
            return None
        keep = [s for s in range(self.slots) if not (drop_slots and s in free)]
        n, cut = self.columns, lead if drop_columns else 0
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.layers:
            for name in ("k_buf", "v_buf"):
                old = getattr(layer, name)
                new = old.new_empty(len(keep), old.shape[1], old.shape[2], old.shape[3])  # the same capacity
                new[:, :, : n - cut] = old[index, :, cut:n]
                setattr(layer, name, new)
        mask = self.mask.new_zeros(len(keep), self.capacity)
        mask[:, : n - cut] = self.mask[index, cut:n]
        self.mask = mask
        self.positions = self.positions[index].clone()
        self.free = [k for k, s in enumerate(keep) if s in free]
        self.slots, self.columns = len(keep), n - cut
        self._sync()
        return {s: k for k, s in enumerate(keep)}
