"""The decoder's per-sequence rows (`forge.runtime.decoder.rows_kv`): a block placed without moving the
running rows, each row read at its own length, and what is allocated close to what the tokens need."""

from __future__ import annotations

import torch

from forge.runtime.decoder.rows_kv import STEP, RowKV


def _kv(rows: int, width: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 2, width, 4, generator=g), torch.randn(rows, 2, width, 4, generator=g)) for _ in range(3)
    ]


def test_a_placed_block_moves_no_running_row_and_each_row_reads_its_own_length():
    kv = RowKV(3, "cpu")
    first = _kv(2, 5, 0)
    a = kv.place(first, [0, 2], [5, 3], torch.tensor([5, 3]))  # row 1: its tokens at columns 2..4
    held = [layer.k_buf[a].clone() for layer in kv.layers]
    kv.before_step()
    assert kv.keep is not None and kv.keep[:, 0, 0].sum(1).tolist() == [6, 4]  # its tokens and the new one
    new = torch.ones(2, 2, 1, 4)
    for layer in kv.layers:
        layer.update(new, new)
    kv.after_step()
    assert kv.lens[a].tolist() == [6, 4]
    for layer, before in zip(kv.layers, held):
        assert torch.equal(layer.k_buf[a[0], :, :5], before[0, :, :5])
        assert torch.equal(layer.k_buf[a[1], :, :3], first[0][0][1, :, 2:5]) or layer is not kv.layers[0]
        assert torch.equal(layer.k_buf[a[1], :, 3], new[1, :, 0])  # written at its own length
    kept = [layer.k_buf[a].clone() for layer in kv.layers]
    b = kv.place(_kv(3, 40, 1), [0, 0, 0], [40, 12, 1], torch.tensor([40, 12, 1]))  # wider: grows the columns
    assert set(b).isdisjoint(a) and kv.capacity == -(-41 // STEP) * STEP
    for layer, before in zip(kv.layers, kept):
        assert torch.equal(layer.k_buf[a, :, :6], before[:, :, :6])  # not shifted


def test_rows_held_stay_close_to_the_tokens_and_freed_rows_are_dropped():
    kv = RowKV(3, "cpu")
    rows = kv.place(_kv(8, 100, 2), [0] * 8, [100 - k for k in range(8)], torch.arange(8))
    for _ in range(20):
        kv.before_step()
        for layer in kv.layers:
            layer.update(torch.zeros(kv.slots, 2, 1, 4), torch.zeros(kv.slots, 2, 1, 4))
        kv.after_step()
        kv.note_held(0, 0)
    # allocated: the tokens, at most STEP columns more a row, and one layer's key or value buffer during a copy
    bound = (kv.held_peak_bytes + kv.slots * STEP * kv.column_bytes) * (1 + 1 / (2 * len(kv.layers)))
    assert kv.held_peak_bytes < kv.peak_bytes <= bound, (kv.peak_bytes, kv.held_peak_bytes)
    for r in rows[:4]:
        kv.release(r)
    moved = kv.tidy()
    assert moved is not None and kv.slots == 4 and kv.lens.tolist() == [116, 115, 114, 113]
