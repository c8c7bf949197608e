"""Per-row intervention parameters, resolved when each row is read (`forge.runtime.hooks.interventions`).

An ``intervene:`` entry may read a value from each input row (``scale: row.scale``,
``index: row.dir``, ``source: row.clean_id``, ``span: row.pos``) or name positions counted from
the end (``span: [-1]``). `RowSteer.resolve` turns one item's row into an `EntryRow` per such
entry, kept in the item's meta (`ItemMeta.steer`): the positions it changes (resolved against the
item's own length), its scale, its vector's index, and, for ``op: patch``, the source item's
token ids and the source positions whose activation goes where. What cannot be resolved (a
position past the item's end, a missing column, a source row that is not in the input) is the
row's recorded failure, with the reason, before any work.

An item whose prefix tokens such an entry changes gets a prefix key of its own (the entry's
resolved values at the prefix's positions, hashed), so items share a prefix's keys and values,
and the prefix cache serves it, only when the prefix ran with the same changes.

Sources: `build_sources` reads the input once more for the rows that some row names as its
source and tokenizes them exactly as their own items are (a source row may be any row, before
or after the rows that name it). A target item takes the source row's item of the same suffix
(score's choice ``q1/2`` takes ``q0/2``).
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from forge.errors import ForgeError
from forge.io.ids import canonical_id, short
from forge.runtime.hooks.interventions import ROW, SPANS, Intervention, Interventions
from forge.vocab.geometry import Item

SourceIndex = dict[str, dict[Any, tuple[np.ndarray, int]]]  # row id -> {its items' suffix: (token ids, prefix length)}


@dataclass(frozen=True, slots=True)
class EntryRow:
    """One row-dependent entry's parameters for one item."""

    positions: tuple[int, ...] | None  # the positions (in its sequence) it changes; None: its named span
    scale: float | None = None  # add: this row's scale (None: the entry's)
    index: int | None = None  # add/set: the row of the entry's vector table (None: its one vector)
    source: np.ndarray | None = None  # patch: the source item's token ids, prefix first
    source_positions: tuple[int, ...] = ()  # patch: per position changed, the source's position read

    def prefix_part(self, prefix_len: int, named_reach: bool) -> tuple | None:
        """What of it changes the item's prefix tokens (None: nothing does)."""
        if self.positions is None:
            at: tuple = ("named",) if named_reach and prefix_len else ()
            src: tuple = ()
        else:
            pairs = [(p, s) for p, s in zip(self.positions, self.source_positions or self.positions) if p < prefix_len]
            at, src = tuple(p for p, _ in pairs), tuple(s for _, s in pairs)
        if not at:
            return None
        digest = (
            None if self.source is None else hashlib.sha256(np.asarray(self.source, np.int64).tobytes()).hexdigest()
        )
        return (at, self.scale, self.index, digest, src if self.source is not None else ())


def named_positions(span: str, n: int, prefix_len: int, end: int | None = None) -> list[int]:
    """The positions of a sequence of n tokens (prefix first) a named span covers; `end`: where a
    generation of it may reach (its prompt's n tokens and its max_new_tokens), for ``generated``."""
    if span == "generated":
        return list(range(n, n if end is None else end))
    if span == "text":
        return list(range(prefix_len, n))
    if span == "prefix":
        return list(range(prefix_len))
    if span == "all":
        return list(range(n))
    return [n - 1] if n > prefix_len else []  # last


class RowSteer:
    """Resolves the row-dependent entries of a function's interventions for each item."""

    def __init__(self, interventions: Interventions, sources: Callable[[], SourceIndex]):
        self.entries = interventions.items
        self.keyed = interventions.key is not None  # some entry can reach prefix tokens
        self._sources = sources  # built on first need (it reads the input)

    def resolve(self, row: Any, suffix: Any, item: Item) -> Item | str:
        """`item` with its entries' parameters in its meta (and its own prefix key where they change
        its prefix), or why its row cannot have them."""
        steer: list[EntryRow | None] = []
        parts = []
        for k, iv in enumerate(self.entries):
            if not iv.row_dependent:
                end = _reach(item)
                past = [p for p in iv.span if p >= end] if isinstance(iv.span, tuple) else []
                if past:  # (positions from 0 apply alike in every item: only checked here)
                    whose = "the item" if end == item.num_tokens else "the prompt and its max_new_tokens"
                    return f"intervene[{k}].span: {_positions(past[:1], end, whose)}"
                steer.append(None)
                continue
            made = self._entry(k, iv, row.data, suffix, item, _reach(item))
            if isinstance(made, str):
                return f"intervene[{k}].{made}"
            steer.append(made)
            if iv.touches_prefix and (part := made.prefix_part(item.prefix_len, iv.span in ("prefix", "all"))):
                parts.append((k, part))
        key = item.prefix_key
        if parts and key is not None and self.keyed:
            key = f"{key}.{hashlib.sha256(repr(parts).encode()).hexdigest()[:16]}"
        return replace(item, prefix_key=key, meta=replace(item.meta, steer=tuple(steer)))

    def _entry(self, k: int, iv: Intervention, data: dict, suffix: Any, item: Item, end: int) -> EntryRow | str:
        """The entry's parameters for one item; `end`: the positions its sequence may reach (past its
        n prompt tokens for a generation: its max_new_tokens; a generation's positions never count
        from the end, which it has not reached)."""
        values: dict[str, Any] = {}
        for parameter, column in iv.rows:
            if parameter == "source" and data.get(column) in (None, ""):  # empty or missing: no source
                self._sources()  # (refuses a run where no row names a source: a misspelt column)
                return EntryRow(())  # a row naming no source is not patched (it may be one)
            if column not in data or data[column] is None:
                return f"{parameter}: the row has no {column!r} field ({parameter}: {ROW}{column}); give every row one"
            values[parameter] = data[column]
        scale = index = None
        if "scale" in values:
            scale = _number(values["scale"])
            if scale is None:
                return f"scale: {short(values['scale'])} in {iv.column('scale')!r} is not a finite number"
        if "index" in values:
            index = _whole(values["index"])
            if index is None or not 0 <= index < len(iv.table or ()):
                size, got = len(iv.table or ()), short(values["index"])
                return f"index: {got} in {iv.column('index')!r} is not a row of the vector file (0..{size - 1})"
        n, prefix_len = item.num_tokens, item.prefix_len
        generates = end > n
        wanted = values.get("span", iv.span)
        if isinstance(wanted, str) and wanted in SPANS:  # a named span (the entry's, or the row's own)
            if wanted == "generated" and (not generates or iv.op == "patch"):
                why = (
                    "a source row has no generated tokens to patch from"
                    if generates
                    else "this function generates none"
                )
                return f"span: 'generated' is not a span here ({why}); name the prompt's positions"
            if iv.op != "patch" and "span" not in values:
                return EntryRow(None, scale, index)
            positions = named_positions(wanted, n, prefix_len, end)
        else:
            resolved = _positions(wanted, end, "the prompt and its max_new_tokens" if generates else "the item",
                                  from_end=not generates)  # fmt: skip
            if isinstance(resolved, str):
                where = f" ({iv.column('span')!r})" if "span" in values else ""
                return f"span{where}: {resolved}"
            positions = resolved
        if iv.op != "patch":
            return EntryRow(tuple(sorted(set(positions))), scale, index)
        return self._patch(iv, values, wanted, suffix, positions)

    def _patch(self, iv: Intervention, values: dict, wanted: Any, suffix: Any, positions: list[int]) -> EntryRow | str:
        raw = values.get("source", iv.source)
        sid, problem = canonical_id(raw, -1)
        if problem is not None:
            return f"source: {short(raw)} is not a row id (a string or an integer)"
        items = self._sources().get(sid)
        if items is None:
            return f"source: no row with id {sid!r} in the input could be its source (it is missing or failed)"
        made = items.get(suffix)
        if made is None:
            name = sid if suffix is None else f"{sid}/{suffix}"
            return f"source: its source row {sid!r} makes no item {name!r}"
        tokens, prefix_len = made
        m = len(tokens)
        if isinstance(wanted, str):
            source = named_positions(wanted, m, prefix_len)
            if len(source) != len(positions):
                return (
                    f"span: {wanted} covers {len(positions)} token(s) of the item but {len(source)} of its "
                    f"source {sid!r}; patch named positions (span: [-1]) where lengths differ"
                )
        else:
            resolved = _positions(wanted, m, f"its source {sid!r}")
            if isinstance(resolved, str):
                return f"span: {resolved}"
            source = resolved
        if len(set(positions)) != len(positions):
            return f"span: {list(wanted)} names one token of the item twice"
        return EntryRow(tuple(positions), None, None, tokens, tuple(source))


def build_sources(
    interventions: Interventions,
    rows: Callable[[], Iterable[Any]],
    items_of: Callable[[list[Any]], Iterable[tuple[Any, Any, Any]]],
) -> SourceIndex:
    """{row id: {suffix: tokens}} of every row some row names as a patch source: one pass over
    `rows()` for the names, one more for the rows named; `items_of(rows)` makes each row's items
    ((row, suffix, Item or a Rejected)) exactly as the run does."""
    patches = [iv for iv in interventions.items if iv.op == "patch"]
    wanted = {iv.source for iv in patches if iv.source is not None}
    columns = [c for iv in patches if (c := iv.column("source"))]
    if columns:
        for row in rows():
            data = getattr(row, "data", None)
            named = [data.get(c) for c in columns] if isinstance(data, dict) else []
            wanted.update(got[0] for v in named if v is not None and (got := canonical_id(v, -1))[1] is None)
    if not wanted:
        fields = " or ".join(repr(c) for c in columns)
        raise ForgeError(f"intervene: op=patch reads each row's source from {fields}, but no row names one")
    found = [row for row in rows() if getattr(row, "id", None) in wanted and isinstance(getattr(row, "data", 0), dict)]
    index: SourceIndex = {}
    for row, suffix, item in items_of(found):
        if isinstance(item, Item) and item.tokens is not None:
            index.setdefault(row.id, {})[suffix] = (np.asarray(item.tokens, dtype=np.int32), item.prefix_len)
    return index


def _positions(wanted: Any, n: int, whose: str, from_end: bool = True) -> list[int] | str:
    """Positions of a sequence of n tokens (negative: from its end), or why they are not.
    `from_end` False: a generation's, which has no end to count from yet."""
    values = list(wanted) if isinstance(wanted, (list, tuple)) else [wanted]
    out = []
    for p in values:
        q = _whole(p)
        if q is None:
            ends = "; negative counts from the end" if from_end else ", from 0"
            return f"{short(p)} is not a position (a whole number{ends})"
        if q < 0 and not from_end:
            return (
                f"position {q} counts from the end, which a generation has not reached; use span last "
                "(the prompt's last token), generated, or positions from 0"
            )
        if not -n <= q < n:
            ends = f", or -{n}..-1" if from_end else ""
            return f"position {q} is past the end of {whose}, which has {n} tokens (positions 0..{n - 1}{ends})"
        out.append(q % n)
    if not out:
        return "no position named; give at least one"
    return out


def _reach(item: Item) -> int:
    """The positions an item's sequence may reach: its tokens, and a generation's max_new_tokens after them."""
    return item.num_tokens + int(getattr(getattr(item.meta, "data", None), "max_new_tokens", 0) or 0)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _whole(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        return None
    return int(value)


_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> its SourceIndex (read once)


def steer_for(fn: Any) -> Callable[[Any, Any, Item], Item | str] | None:
    """`RowSteer.resolve` for a model function's items (None: no entry needs its rows); the
    patch sources are read from its input on first need, once per function object."""
    if not fn.interventions.checks_rows:
        return None

    def sources() -> SourceIndex:
        index = _SOURCES.get(fn)
        if index is None:
            index = _SOURCES[fn] = build_sources(fn.interventions, fn.rows, lambda rows: _items_of(fn, rows))
        return index

    return RowSteer(fn.interventions, sources).resolve


def _items_of(fn: Any, rows: list[Any]) -> Iterator[tuple[Any, Any, Any]]:
    """(row, suffix, Item or why not) of each of `rows`' prompts, as the function's run makes them."""
    from forge.runtime.tokens.prompts import make_items, tokenized

    pending = [(row, p, 0) for row in rows if isinstance(made := fn.prompts(row), list) for p in made]
    made = tokenized(fn.tokenize, [p for _, p, _ in pending])
    for (row, p, _), item in zip(pending, make_items(pending, made, False)):
        yield row, p.suffix, item
