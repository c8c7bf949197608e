"""The KV cache of a decoding batch read by Forge's own attention: one left-aligned row per sequence.

Model: every layer's keys and values live in one buffer ``[rows, kv heads, capacity, head dim]``.
Row ``r`` holds its sequence's own tokens (those past a shared prefix, which decode steps read
once per group, `forge.runtime.forward.shared_prefix`) at columns ``[0, lens[r])``; a decode
step writes each row's new column at ``lens[r]`` (one indexed write per layer) and attention
reads each row's own length (`keep`: ``column < lens + 1``), never a column of another
sequence. So a sequence grows without moving others, a block is placed into free rows at
column 0 (no shift of the running rows), and attention reads the buffer whole: a contiguous
matmul, the capacity kept within `STEP` columns of the longest row.

Bytes: a row's column over every layer costs `column_bytes`; the buffers hold rows x capacity
of them. Growth (more rows for a block, `STEP` more columns when the longest row reaches the
capacity) replaces one layer's buffer at a time (`SlotKV._replace`'s rule): `peak_bytes` records
the most held at once, that transient and what the owner holds `beside` included. `held_tokens`
is what the running rows actually hold; `tidy` drops free rows and unused columns.

Only for models whose attention Forge's own function computes (`shared_prefix.install`):
transformers' mask is not used in a decode step, so column order means nothing to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from forge.runtime.decoder.heap import release_free_heap

STEP = 16  # columns added at a time: a whole-buffer copy every STEP decode steps of the longest row


class RowLayer(DynamicLayer):
    """One layer's keys and values in `RowKV`'s buffers; a decode step writes each row's column at its length."""

    def __init__(self, owner: RowKV) -> None:
        super().__init__()
        self.owner = owner
        self.k_buf = torch.empty(0)
        self.v_buf = torch.empty(0)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a row layer is filled by RowKV.place, before the first decoding step")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        rows, cols = self.owner.write_at
        self.k_buf[rows, :, cols] = key_states[:, :, 0]
        self.v_buf[rows, :, cols] = value_states[:, :, 0]
        return self.k_buf, self.v_buf

    def get_seq_length(self) -> int:
        return max(0, self.owner.capacity - 1)


class RowKV:
    """Left-aligned rows of running sequences over every layer's `RowLayer`, with their lengths and next positions."""

    def __init__(self, num_layers: int, device: Any):
        self.layers = [RowLayer(self) for _ in range(num_layers)]
        self.cache = Cache(layers=list[Any](self.layers))
        self.device = device
        self.lens = torch.zeros(0, dtype=torch.long)  # tokens each row holds (0: free), on the CPU
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # each row's next position
        self.free: list[int] = []
        self.slots = 0
        self.capacity = 0
        self.column_bytes = 0
        self.limit: int | None = None
        self.beside = 0
        self.peak_bytes = 0
        self.held_peak_bytes = 0  # the most the rows' own tokens and what is beside them held at once
        self.write_at: tuple[torch.Tensor, torch.Tensor] = (self.lens, self.lens)
        self.keep: torch.Tensor | None = None  # [rows, 1, 1, capacity] bool: the columns a step reads

    @property
    def columns(self) -> int:
        """The longest row's tokens."""
        return int(self.lens.max()) if self.slots else 0

    def held_bytes(self, slots: int | None = None, capacity: int | None = None) -> int:
        slots = self.slots if slots is None else slots
        return slots * (self.capacity if capacity is None else capacity) * self.column_bytes

    def held_tokens(self) -> int:
        return int(self.lens.sum())

    def usable(self, limit: int) -> int:
        layers = len(self.layers)
        return limit * layers // (layers + 1)

    @staticmethod
    def _round(columns: int) -> int:
        return -(-columns // STEP) * STEP

    def grow_fits(self, limit: int) -> bool:
        capacity = max(self.capacity, self._round(self.columns + 1))
        return self.held_bytes(capacity=capacity) <= self.usable(limit)

    def place_fits(self, rows: int, width: int, limit: int) -> bool:
        slots, capacity = self._placement(rows, width)
        return self.held_bytes(slots, capacity) <= self.usable(limit)

    def _placement(self, rows: int, width: int) -> tuple[int, int]:
        slots = self.slots + max(0, rows - len(self.free))
        return slots, max(self.capacity, self._round(width + 1))

    def reserve(self, slots: int, columns: int) -> None:
        """Nothing held ahead: rows and columns grow with need (kept for `SlotKV`'s interface)."""

    def shape_like(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.layers, kv):
            layer.k_buf = k.new_zeros(0, k.shape[1], 0, k.shape[-1])
            layer.v_buf = v.new_zeros(0, v.shape[1], 0, v.shape[-1])
        self.column_bytes = sum(
            (lay.k_buf.shape[1] * lay.k_buf.shape[3] + lay.v_buf.shape[1] * lay.v_buf.shape[3])
            * lay.k_buf.element_size()
            for lay in self.layers
        )

    def _resize(self, slots: int, capacity: int, keep: list[int] | None = None) -> None:
        """New buffers of `slots` x `capacity`: the kept rows (all by default, in order) first, the
        rest zero (read under a mask: finite). One layer's buffer replaced at a time."""
        index = None if keep is None else torch.tensor(keep, dtype=torch.long)
        n = len(keep) if keep is not None else self.slots
        cols = min(self.capacity, capacity)
        held = self.held_bytes()
        for layer in self.layers:
            for name in ("k_buf", "v_buf"):
                old = getattr(layer, name)
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                size = new.numel() * new.element_size()
                self.peak_bytes = max(self.peak_bytes, self.beside + held + size)
                new[:n, :, :cols] = (old if index is None else old[index])[:, :, :cols]
                setattr(layer, name, new)
                held += size - old.numel() * old.element_size()
                del old, new
        lens = self.lens.new_zeros(slots)
        positions = self.positions.new_zeros(slots)
        lens[:n] = self.lens if index is None else self.lens[index]
        positions[:n] = self.positions if index is None else self.positions[index.to(self.positions.device)]
        self.lens, self.positions = lens, positions
        self.slots, self.capacity = slots, capacity
        release_free_heap()  # the old buffers: the new ones are larger or fewer, not refilled from them

    def place(self, kv: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int], lens: list[int],
              positions: torch.Tensor) -> list[int]:  # fmt: skip
        """Put a block of sequences in free rows: per layer their keys and values ``[rows, heads,
        width, dim]``, row i's tokens at columns ``[starts[i], starts[i] + lens[i])``; `positions`:
        each one's next position. Returns their rows, in order."""
        rows = len(starts)
        if not self.column_bytes:
            self.shape_like(kv)
        self.make_room(rows, max(lens))
        taken, self.free = self.free[:rows], self.free[rows:]
        width, most = kv[0][0].shape[2], max(lens)
        src = (torch.tensor(starts)[:, None] + torch.arange(most)[None]).clamp(max=width - 1)
        index = torch.tensor(taken, dtype=torch.long)
        for layer, (k, v) in zip(self.layers, kv):
            at = src.to(k.device)[:, None, :, None].expand(rows, k.shape[1], most, k.shape[3])
            layer.k_buf[index, :, :most] = k.gather(2, at)
            layer.v_buf[index, :, :most] = v.gather(2, at)
        self.lens[index] = torch.tensor(lens, dtype=torch.long)
        self.positions[index.to(self.positions.device)] = positions
        return taken

    def make_room(self, rows: int, width: int) -> None:
        """Free rows for `rows` more sequences of up to `width` tokens, in one resize (a block placed
        part by part would otherwise resize, old and new buffers side by side, once per part)."""
        slots, capacity = self._placement(rows, width)
        if (slots, capacity) != (self.slots, self.capacity):
            before = self.slots
            self._resize(slots, capacity)
            self.free += range(before, slots)

    def release(self, slot: int) -> None:
        self.lens[slot] = 0
        self.free.append(slot)

    def before_step(self) -> None:
        """Room for each row's next column; the step's write columns and the columns it reads."""
        if self.columns + 1 > self.capacity:
            self._resize(self.slots, self._round(self.columns + 1))
        rows = torch.arange(self.slots)
        self.write_at = (rows, self.lens.clone())
        cols = torch.arange(self.capacity)
        self.keep = (cols[None] <= self.lens[:, None])[:, None, None].to(self.device)

    def after_step(self) -> None:
        self.lens += 1
        if self.free:
            self.lens[self.free] = 0
        self.positions += 1
        self.keep = None

    def step_mask(self) -> None:
        return None  # the rows' lengths, not a mask, say what a step reads (`keep`)

    def note_held(self, beside_held: int, beside_bytes: int) -> None:
        """Record what is held now: the rows' own tokens and `beside_held` bytes of tokens beside
        them; the buffers and `beside_bytes` allocated beside them."""
        self.held_peak_bytes = max(self.held_peak_bytes, self.held_tokens() * self.column_bytes + beside_held)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes() + beside_bytes)

    def tidy(self, force: bool = False) -> dict[int, int] | None:
        """Drop free rows once they are a quarter of the rows, and columns past the longest row's
        next `STEP` once they are a quarter of the capacity (`force`: any).
        Returns each kept row's new number, or None when nothing moved."""
        free = set(self.free)
        need = self._round(self.columns + 1) if self.slots else 0
        drop_rows = bool(free) and (force or len(free) * 4 >= self.slots)
        drop_cols = self.capacity > need and (force or (self.capacity - need) * 4 >= self.capacity)
        if not (drop_rows or drop_cols):
            return None
        keep = [s for s in range(self.slots) if not (drop_rows and s in free)]
        self._resize(len(keep), need if drop_cols else self.capacity, keep)
        self.free = [k for k, s in enumerate(keep) if s in free]
        return {s: k for k, s in enumerate(keep)}
