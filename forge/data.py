"""Per-token states of a run, streamed for training (sparse autoencoders, dictionaries, probes).

    from torch.utils.data import DataLoader
    from forge.data import token_states

    ds = token_states("runs/acts", layer=2, batch_size=4096, shuffle_buffer=1 << 20, seed=0)
    for batch in DataLoader(ds, batch_size=None, num_workers=2):  # batch: [4096, hidden]
        ...

Model: a `probe_gen` run with `pooling=none` stores, per item, the states of its own tokens
(after its prefix) at each layer in ragged safetensors shards under ``activations/``
(`layer_<L>`: the values end to end; `layer_<L>.offsets`: where each item starts), with
`token_ids`, `prefix_id` and `prefix_len`; with `prefix_states=once`, each distinct prefix's
states once under ``prefix_states/``. `token_states` reads only committed shards (the journal).

Each epoch orders the shards by a permutation drawn from (seed, epoch). Each reader, one per
`DataLoader` worker and rank, takes its share: on a local disk a contiguous slice of every
shard's items, read through safetensors' memory map; on an object store (an fsspec URL) whole
shards, round robin, each fetched to a temporary file. Tokens pass through a shuffle buffer:
once it holds `shuffle_buffer` tokens it is permuted and its first half is emitted as batches
of `batch_size`. So every committed token comes out exactly once per epoch across all readers,
the order depends only on (seed, epoch, world size, workers), and memory is the buffer plus one
chunk being read (`chunk_tokens`), plus the journal (about a hundred bytes per item), never
the run's size.

Prefix tokens (`prefix`): "drop" streams items' own tokens only; "once" also streams each
distinct prefix's stored states once; "each" puts the prefix's states back in front of every
item (the distinct prefixes are held in memory), so each item comes out whole.
"""

from __future__ import annotations

import posixpath
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from forge.errors import ForgeError
from forge.io.location import open_location
from forge.io.results import OFFSETS, read_info
from forge.io.store import read_journal

ITEMS, PREFIXES = "activations", "prefix_states"
PREFIX_MODES = ("drop", "once", "each")


@dataclass(frozen=True)
class Shard:
    """One committed shard of a per-token folder."""

    file: str  # path in the run directory
    index: tuple[int, ...]  # each row's input index (its item's commit key)
    ids: tuple[str, ...]  # each row's item id
    prefixes: bool  # a shard of prefix_states/ (each row: one prefix's states)


def token_states(
    run_dir,
    layer: int | str | None = None,
    batch_size: int = 4096,
    shuffle_buffer: int = 1 << 20,
    seed: int = 0,
    *,
    prefix: str = "drop",
    with_ids: bool = False,
    dtype: torch.dtype | None = None,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    chunk_tokens: int = 1 << 16,
    field: str | None = None,
) -> TokenStates:
    """An `IterableDataset` of [batch_size, width] state batches of `layer` (`layer_<L>`), or of
    any stored per-token field (`field="mlp_out.2"`, a capture; a string `layer` names a field
    too), from a pooling=none run (a local path or an fsspec URL). `with_ids`: dicts with `states`, `token_ids`,
    `item_index`, `position` (in the item's whole sequence) and `item_id` instead. `rank` and
    `world_size` default to torch.distributed's when it is initialized. See the module doc."""
    return TokenStates(
        run_dir,
        layer,
        batch_size,
        shuffle_buffer,
        seed,
        prefix=prefix,
        with_ids=with_ids,
        dtype=dtype,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        chunk_tokens=chunk_tokens,
        field=field,
    )


class TokenStates(IterableDataset):
    """Shuffled batches of per-token states; `set_epoch(e)` changes the order (as DistributedSampler)."""

    def __init__(
        self,
        run_dir,
        layer: int,
        batch_size: int,
        shuffle_buffer: int,
        seed: int,
        *,
        prefix: str,
        with_ids: bool,
        dtype: torch.dtype | None,
        drop_last: bool,
        rank: int | None,
        world_size: int | None,
        chunk_tokens: int,
        field: str | None = None,
    ):
        if prefix not in PREFIX_MODES:
            raise ForgeError(f"prefix={prefix!r}; choose one of: {', '.join(PREFIX_MODES)}")
        for name, value in (
            ("batch_size", batch_size),
            ("shuffle_buffer", shuffle_buffer),
            ("chunk_tokens", chunk_tokens),
        ):
            if int(value) < 1:
                raise ForgeError(f"{name}={value}: must be positive")
        self.run_dir, self.prefix = run_dir, prefix
        self.batch_size, self.shuffle_buffer, self.chunk_tokens = (
            int(batch_size),
            int(shuffle_buffer),
            int(chunk_tokens),
        )
        self.seed, self.epoch, self.with_ids, self.dtype, self.drop_last = int(seed), 0, with_ids, dtype, drop_last
        self.rank, self.world_size = rank, world_size
        info = read_info(run_dir, ITEMS)
        if info.get("pooling") != "none":
            raise ForgeError(
                f"{run_dir}: {ITEMS}/ holds pooled states (pooling={info.get('pooling')}); per-token "
                "states come from `forge run function=probe_gen pooling=none`"
            )
        self.field = _field_of(run_dir, info, layer, field)
        self.stored_prefixes = info.get("prefix_states") == "once"
        if prefix != "drop" and not self.stored_prefixes:
            raise ForgeError(
                f"prefix={prefix}: the run stored no prefix states (prefix_states=none); use prefix=drop "
                "or rerun with prefix_states=once"
            )
        folders = {ITEMS: False, **({PREFIXES: True} if prefix == "once" else {})}
        self.shards = [
            Shard(line["file"], tuple(line["index"]), tuple(line["ids"]), folders[folder])
            for line in read_journal(run_dir)
            if (folder := posixpath.dirname(line["file"])) in folders
        ]
        self.max_pool_tokens = 0  # the most tokens the shuffle buffer held (this reader, this process)
        self._ids: dict[int, str] | None = None  # input index -> item id, read on first use (with_ids)
        self._prefixes: dict[int, dict[str, torch.Tensor]] | None = None  # prefix id -> its states (prefix=each)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    # -- who reads what ---------------------------------------------------------------
    def _reader(self) -> tuple[int, int]:
        """(this reader's number, how many readers): ranks x DataLoader workers."""
        rank, world = self.rank, self.world_size
        if world is None:
            dist = torch.distributed
            on = dist.is_available() and dist.is_initialized()
            world, rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)
        rank = 0 if rank is None else rank
        worker = get_worker_info()
        workers, wid = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        if not 0 <= rank < world:
            raise ForgeError(f"rank={rank} with world_size={world}: rank must be in 0..{world - 1}")
        return rank * workers + wid, world * workers

    def _units(self, reader: int, readers: int) -> list[tuple[Shard, int, int]]:
        """(shard, first row, end row) this reader streams this epoch, in order."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.shards))
        where = open_location(self.run_dir)
        units = []
        for k, s in enumerate(self.shards[i] for i in order):
            n = len(s.index)
            if where.local_file(s.file) is not None:  # a slice of every shard: memory-mapped reads
                lo, hi = n * reader // readers, n * (reader + 1) // readers
                if hi > lo:
                    units.append((s, lo, hi))
            elif k % readers == reader:  # an object store: whole shards, each fetched once
                units.append((s, 0, n))
        return units

    # -- reading ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        reader, readers = self._reader()
        g = torch.Generator().manual_seed(
            int(np.random.default_rng([self.seed, self.epoch, reader, readers]).integers(1 << 62))
        )
        pool: list[dict[str, Any]] = []
        held = 0
        for unit in self._units(reader, readers):
            for chunk in self._chunks(*unit):
                pool.append(chunk)
                held += len(chunk["states"])
                self.max_pool_tokens = max(self.max_pool_tokens, held)
                if held >= self.shuffle_buffer + self.batch_size:
                    mixed = _permuted(_cat(pool), g)
                    emit = (held - self.shuffle_buffer // 2) // self.batch_size * self.batch_size
                    yield from self._batches(_take(mixed, 0, emit))
                    pool, held = [_take(mixed, emit, held)], held - emit
        if held:
            rest = _permuted(_cat(pool), g)
            end = held if not self.drop_last else held // self.batch_size * self.batch_size
            yield from self._batches(_take(rest, 0, end))

    def _batches(self, part: dict[str, Any]) -> Iterator[Any]:
        n = len(part["states"])
        for lo in range(0, n, self.batch_size):
            batch = _take(part, lo, min(n, lo + self.batch_size))
            states = batch["states"] if self.dtype is None else batch["states"].to(self.dtype)
            if not self.with_ids:
                yield states
                continue
            ids = self._item_ids()
            yield {
                "states": states,
                "token_ids": batch["token_ids"],
                "item_index": batch["item_index"],
                "position": batch["position"],
                "item_id": [ids[i] for i in batch["item_index"].tolist()],
            }

    def _item_ids(self) -> dict[int, str]:
        if self._ids is None:
            self._ids = {i: name for s in self.shards for i, name in zip(s.index, s.ids)}
        return self._ids

    def _chunks(self, shard: Shard, lo: int, hi: int) -> Iterator[dict[str, Any]]:
        """The unit's tokens in chunks of whole items, about `chunk_tokens` each."""
        with _opened(self.run_dir, shard.file) as f:
            offsets = f.get_tensor(self.field + OFFSETS)
            values, token_ids = f.get_slice(self.field), f.get_slice("token_ids")
            prefix_len = (
                f.get_tensor("prefix_len")
                if "prefix_len" in f.keys()
                else torch.zeros(len(offsets) - 1, dtype=torch.int32)
            )
            prefix_ids = f.get_tensor("prefix_id")
            index = torch.as_tensor(shard.index, dtype=torch.long)
            a = lo
            while a < hi:
                b = int(torch.searchsorted(offsets, offsets[a] + self.chunk_tokens, right=True)) - 1
                b = min(hi, max(b, a + 1))
                t0, t1 = int(offsets[a]), int(offsets[b])
                counts = (offsets[a + 1 : b + 1] - offsets[a:b]).long()
                chunk = {
                    "states": values[t0:t1],
                    "token_ids": token_ids[t0:t1].long(),
                    "item_index": torch.repeat_interleave(index[a:b], counts),
                    "position": _positions(counts)
                    + torch.repeat_interleave(
                        prefix_len[a:b].long() if not shard.prefixes else torch.zeros(b - a, dtype=torch.long), counts
                    ),
                }
                if self.prefix == "each":
                    chunk = self._with_prefixes(chunk, prefix_ids[a:b], counts)
                yield chunk if self.with_ids else {"states": chunk["states"]}  # shuffle only what is yielded
                a = b

    def _with_prefixes(self, chunk: dict[str, Any], prefix_ids: torch.Tensor, counts: torch.Tensor) -> dict[str, Any]:
        """Each item's prefix states (held once per reader) put back in front of its own tokens."""
        table = self._prefix_table()
        parts: list[dict[str, Any]] = []
        start = 0
        for pid, n in zip(prefix_ids.tolist(), counts.tolist()):
            own = _take(chunk, start, start + n)
            start += n
            if pid >= 0:
                if pid not in table:
                    raise ForgeError(
                        f"{self.run_dir}: prefix {pid:012x} has no stored states (a run that did not "
                        "finish?); resume it, or use prefix=drop"
                    )
                pre = table[pid]
                parts += [{**pre, "item_index": own["item_index"][:1].expand(len(pre["states"]))}, own]
            else:
                parts.append(own)
        return _cat(parts)

    def _prefix_table(self) -> dict[int, dict[str, torch.Tensor]]:
        if self._prefixes is None:
            self._prefixes = {}
            for line in read_journal(self.run_dir):
                if posixpath.dirname(line["file"]) != PREFIXES:
                    continue
                with _opened(self.run_dir, line["file"]) as f:
                    offsets = f.get_tensor(self.field + OFFSETS).tolist()
                    values, token_ids = f.get_tensor(self.field), f.get_tensor("token_ids").long()
                    for r, pid in enumerate(f.get_tensor("prefix_id").tolist()):
                        a, b = offsets[r], offsets[r + 1]
                        self._prefixes[pid] = {
                            "states": values[a:b].clone(),
                            "token_ids": token_ids[a:b].clone(),
                            "position": torch.arange(b - a),
                        }
        return self._prefixes


def _field_of(run_dir, info: dict[str, Any], layer: int | str | None, field: str | None) -> str:
    """The stored per-token field `layer` (an int: `layer_<L>`; a string: a field's name) or
    `field` names; one line listing those there are where it names none."""
    per_token = [f["name"] for f in info["fields"] if f.get("ragged") and f["name"] != "token_ids"]
    if (layer is None) == (field is None):
        raise ForgeError(f"token_states: give layer=L or field=NAME (not both); this run stores {', '.join(per_token)}")
    name = field if field is not None else layer if isinstance(layer, str) else f"layer_{layer}"
    if name not in per_token:
        layers = info.get("layers") or []
        others = [n for n in per_token if n not in {f"layer_{x}" for x in layers}]
        also = f" (or field= one of {', '.join(others)})" if others else ""
        if field is None and not isinstance(layer, str):
            raise ForgeError(f"layer={layer}: the run stored layers {layers}; choose one of them{also}")
        raise ForgeError(f"field={name!r}: {run_dir} stores {', '.join(per_token)} per token; choose one of them")
    return str(name)


@contextmanager
def _opened(run_dir, rel: str):
    """A shard opened with safetensors (torch): mapped from a local disk, else fetched to a temporary file."""
    from safetensors import safe_open

    where = open_location(run_dir)
    path = where.local_file(rel)
    if path is not None:
        with safe_open(str(path), framework="pt") as f:
            yield f
        return
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:
        tmp.write(where.read_bytes(rel))
        tmp.flush()
        with safe_open(tmp.name, framework="pt") as f:
            yield f


def _positions(counts: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each count, end to end."""
    total = int(counts.sum())
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.arange(total) - starts


def _cat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _take(part: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {k: v[lo:hi] for k, v in part.items()}


def _permuted(part: dict[str, Any], g: torch.Generator) -> dict[str, Any]:
    perm = torch.randperm(len(part["states"]), generator=g)
    return {k: torch.index_select(v, 0, perm) for k, v in part.items()}  # index_select: ~3x v[perm] on CPU
