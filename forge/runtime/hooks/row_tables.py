"""Per-row interventions in a batch: each item's own parameters as tensors the hooks gather per slot.

Model: every item carries its row-dependent entries' parameters (`ItemMeta.steer`, resolved when
its row was read: `forge.runtime.hooks.row_steer`). `RowTables(items, interventions, sources)` stacks
them for one batch: per entry, each item's scale, vector index, covered positions and, for
``op: patch``, the source activations to write at each of its positions. `Slots.item` says which
item each slot of a forward pass holds (a shared prefix's slots: an item holding it, whose prefix
key says its prefix changes like every other's), so `apply` changes each slot by its own item's
parameters, in every layout. The arithmetic is the constant entry's, element for element
(`Intervention.apply`): a row at scale s gives what a run at the constant scale s gives.

Patch sources (`SourceValues`): each source item's whole sequence runs alone through the plain
model (no intervention, no cache, no padding; stopped after the deepest patch point), so its
activation is the same whatever the batching mode; a worker keeps the last ones in a token-bounded
LRU, as a patching sweep reuses one source for many rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from forge.runtime.hooks.points import HookPoint, HookSet, Slots, _path_layer, decoder_layers
from forge.vocab.geometry import Item
from forge.vocab.lru import TokenLRU

SOURCE_CACHE_TOKENS = 1 << 16  # source tokens whose activations a worker keeps


@dataclass
class _Entry:
    cover: torch.Tensor | None  # bool [items, longest]: positions changed (None: the entry's named span)
    scale: torch.Tensor | None  # float64 [items]: each item's scale (None: the entry's)
    index: torch.Tensor | None  # int64 [items]: the row of the vector table (None: the entry's one vector)
    patch: torch.Tensor | None  # int64 [items, longest]: the row of `values` written at a position (-1: none)
    values: torch.Tensor | None  # [patched positions, ...]: the sources' activations, in model dtype


class RowTables:
    """One batch's per-item parameters of its row-dependent entries."""

    def __init__(self, items: list[Item], interventions: list[Any], sources: dict[bytes, dict[str, torch.Tensor]]):
        self.longest = max(it.num_tokens for it in items)
        self._entries: dict[int, _Entry] = {}
        for k, iv in enumerate(interventions):
            if iv.row_dependent:
                rows = [_steer(it, k) for it in items]
                self._entries[id(iv)] = self._entry(iv, rows, sources)

    def _entry(self, iv: Any, rows: list[Any], sources: dict[bytes, dict[str, torch.Tensor]]) -> _Entry:
        n, width = len(rows), self.longest
        cover = None
        if any(r.positions is not None for r in rows):
            cover = torch.zeros(n, width, dtype=torch.bool)
            for i, r in enumerate(rows):
                cover[i, list(r.positions)] = True
        scale = torch.tensor([r.scale for r in rows], dtype=torch.float64) if iv.column("scale") else None
        index = torch.tensor([r.index for r in rows], dtype=torch.long) if iv.column("index") else None
        patch = values = None
        if iv.op == "patch":
            patch = torch.full((n, width), -1, dtype=torch.long)
            parts, used = [], 0
            for i, r in enumerate(rows):
                if r.source is None:
                    continue  # a row naming no source
                got = sources[_key(r.source)][iv.at]
                parts.append(got[list(r.source_positions)])
                patch[i, list(r.positions)] = torch.arange(used, used + len(r.positions))
                used += len(r.positions)
            values = torch.cat(parts) if parts else None
        return _Entry(cover, scale, index, patch, values)

    def apply(self, iv: Any, value: torch.Tensor, slots: Slots) -> torch.Tensor:
        """`value` [rows, tokens, ...] with `iv` applied at each slot by its item's parameters."""
        e = self._entries[id(iv)]
        dev = value.device
        assert slots.item is not None  # (HookSet checks it)
        item = slots.item.to(dev)
        mine, pos = item.clamp(min=0), slots.position.to(dev).clamp(0, self.longest - 1)
        if e.cover is None:
            mask = slots.span(iv.span).to(dev) & (item >= 0)
        else:
            inside = slots.valid.to(dev) & (item >= 0) & (slots.position.to(dev) < self.longest)
            mask = inside & e.cover.to(dev)[mine, pos]
        extra = [1] * (value.dim() - 2)
        if iv.op == "patch":
            assert e.patch is not None
            if e.values is None:
                return value  # no item of the batch names a source
            at = e.patch.to(dev)[mine, pos]
            mask = mask & (at >= 0)
            patched = e.values.to(dev)[at.clamp(min=0)]
            return torch.where(mask.view(*mask.shape, *extra), patched.view(value.shape), value)
        m = mask.view(*mask.shape, *extra)
        if iv.op == "zero":
            return value.masked_fill(m, 0)
        if e.index is None:
            vec = iv.vector_tensor(value)
        else:
            vec = iv.vector_tensor(value, e.index.to(dev)[mine])
            vec = vec.view(*vec.shape[:2], *extra[:-1], vec.shape[-1])
        if iv.op == "set":
            return torch.where(m, vec.expand_as(value), value)
        if e.scale is None:
            return torch.where(m, value + iv.scale * vec, value)
        return torch.where(m, value + _scaled(e.scale.to(dev)[mine].view(*mask.shape, *extra), vec), value)


def _scaled(scale: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """scale * vec as a constant scale's product is (`Intervention.apply`: a Python float times the
    vector): in the vector's dtype, or in float32 for a half-precision one, then rounded to it."""
    if vec.dtype in (torch.float32, torch.float64):
        return scale.to(vec.dtype) * vec
    return (scale.float() * vec.float()).to(vec.dtype)


def _steer(item: Item, k: int) -> Any:
    steer = getattr(item.meta, "steer", None)
    if steer is None or k >= len(steer) or steer[k] is None:
        raise ValueError(f"item {item.id!r} carries no parameters for intervene[{k}] (its row was read without them)")
    return steer[k]


def _key(tokens: Any) -> bytes:
    return torch.as_tensor(tokens, dtype=torch.int32).numpy().tobytes()


class _Stop(Exception):
    """The source pass has every activation it needs: the later layers are not run."""


class SourceValues:
    """Patch sources' activations at the patch points, each source run alone through the plain model."""

    def __init__(self, model: Any, base: Any, num_layers: int, points: list[HookPoint]):
        self.model, self.base, self.num_layers = model, base, num_layers
        self.points = [p.name for p in points]
        layers = [p.layer if p.kind != "module" else _path_layer(model, base, num_layers, p.name) for p in points]
        self.stop_after = None if any(layer is None for layer in layers) else max(layers)  # type: ignore[type-var]
        self.cache = TokenLRU(SOURCE_CACHE_TOKENS)

    def of(self, items: list[Item], device: Any) -> dict[bytes, dict[str, torch.Tensor]]:
        """{source tokens: {patch point: [its tokens, ...]}} for every source the items name."""
        out: dict[bytes, dict[str, torch.Tensor]] = {}
        for it in items:
            for r in getattr(it.meta, "steer", None) or ():
                if r is None or r.source is None or (key := _key(r.source)) in out:
                    continue
                got = self.cache.get(key)
                if got is None:
                    got = self._run(r.source, device)
                    self.cache.put(key, got, len(r.source))
                out[key] = got
        return out

    def _run(self, tokens: Any, device: Any) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(tokens, dtype=torch.long).view(1, -1).to(device)
        n = ids.shape[1]
        capture = HookSet(self.model, self.base, self.num_layers, self.points, [])
        if self.stop_after is not None:
            layer = decoder_layers(self.base, self.num_layers)[self.stop_after]
            capture.handles.append(layer.register_forward_hook(_stop))
        capture.begin(Slots.prefix(n, device), True)
        try:
            self.base(input_ids=ids, position_ids=torch.arange(n, device=device).view(1, n), use_cache=False)
        except _Stop:
            pass
        finally:
            got = capture.end()
            capture.close()
        missing = [p for p in self.points if p not in got]
        if missing:
            raise ValueError(f"patch source: the model's forward pass never reached {missing[0]!r}")
        return {name: value.reshape(n, *value.shape[2:]) if value.dim() > 2 else value for name, value in got.items()}


def _stop(module: Any, args: Any, output: Any) -> None:
    raise _Stop()


def span_items(layout: Any, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Per slot of tree rows: the item holding the prefix span there (-1 elsewhere); `seg` >= n marks
    prefix span g as n + g (`forge.runtime.forward.tree_rows`)."""
    holders = torch.tensor([holder for *_, holder in layout.spans] or [-1], dtype=torch.long)
    return torch.where(seg >= n, holders[(seg - n).clamp(0, len(holders) - 1)], -1)
