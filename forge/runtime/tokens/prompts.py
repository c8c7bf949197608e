"""Prompts to items: batched tokenization by the token rule, and each item's targets. `Prompt`
and `Tokens` (what a row becomes, and its ids) are the public API's (`forge.api`).

`forge.api.ModelFunction.records` gathers prompts in chunks; `tokenized` runs its `tokenize`
over a chunk (a prompt the tokenizer cannot take fails alone, with the error) and
`make_items` turns each prompt's `Tokens` into an `Item` whose meta holds the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge.errors import ForgeError
from forge.runtime.model.spec import first_line
from forge.vocab.geometry import Item
from forge.vocab.records import Rejected


@dataclass(slots=True)
class ItemMeta:
    """What an item carries besides its token ids (`Item.meta`), set when its row is read."""

    targets: tuple[int, ...] = ()  # token ids whose log-probabilities the function reads
    target_start: int = 0  # position (in the item's sequence) whose state predicts targets[0]
    label: Any = None  # the row's label (kept in the journal by functions that keep labels)
    data: Any = None  # whatever the function attached to the item (its own row metadata)
    row: int = -1  # the input row it came from (forge.io.inputs.Row.index)
    steer: Any = None  # per entry of intervene: its parameters for this item (forge.runtime.hooks.row_steer.EntryRow)


@dataclass
class Prompt:
    """What one input row becomes: an item to run (a row may become several)."""

    text: str  # the text, tokenized without special tokens after a prefix (with them alone)
    prefix: str | None = None  # a shared prefix (few-shot examples): run once per batch, cacheable
    label: Any = None  # kept with the item (and in the journal by functions that keep labels)
    data: Any = None  # the function's own per-item metadata, handed back in `ItemView.data`
    suffix: str | None = None  # the item id is "<row id>/<suffix>" (rows that become several items)


@dataclass
class Tokens:
    """A prompt's token ids, as the function's token rule makes them (`ModelFunction.tokenize`)."""

    prefix: list[int]  # the shared prefix's ids ([]: none)
    text: list[int]  # the ids after it: the item's own tokens
    prefix_key: str | None = None  # identity of the prefix (items sharing it share its KV)
    targets: tuple[int, ...] | None = None  # None: the text's tokens given the prefix (the token rule)
    target_start: int | None = None  # position whose state predicts targets[0]; None: the prefix's last


def tokenized(tokenize: Callable[[list[Any]], list[Any]], prompts: list[Any]) -> list[Any]:
    """`tokenize(prompts)`, or, where it raises, each prompt alone: only a prompt the
    tokenizer cannot take fails (with the error); a ForgeError is not a row's fault."""
    try:
        return tokenize(prompts)
    except ForgeError:
        raise
    except Exception:  # noqa: BLE001  (some prompt is odd: find it)
        out: list[Any] = []
        for p in prompts:
            try:
                out += tokenize([p])
            except ForgeError:
                raise
            except Exception as exc:  # noqa: BLE001
                out.append(f"tokenizing failed on it ({first_line(exc)}); fix or drop the row")
        return out


def by_token_rule(rule: Any, encode_texts: Callable[[list[str]], list[list[int]]], prompts: list[Any], tokens: type):
    """Each prompt's `tokens(prefix ids, text ids, prefix key)` by the token rule; batched over
    prompts (`encode_texts`: the texts without a prefix, alone, with the special tokens)."""
    alone = [p.prefix is None for p in prompts]
    texts = iter(rule.texts([p.text for p, a in zip(prompts, alone) if not a], with_special=False))
    wholes = iter(encode_texts([p.text for p, a in zip(prompts, alone) if a]))
    out: list[Any] = []
    for p, whole in zip(prompts, alone):
        if whole:
            out.append(tokens([], next(wholes)))
        else:
            key, prefix_ids = rule.prefix(p.prefix)
            out.append(tokens(prefix_ids, next(texts), key))
    return out


def make_items(
    pending: list[tuple[Any, Any, int]],
    tokens_of: list[Any],
    with_targets: bool,
    key: str | None = None,
    steer: Callable[[Any, Any, Item], Item | str] | None = None,
) -> Iterator[Item | Rejected]:
    """(row, prompt, commit key) with its `Tokens` (or why it has none) -> an `Item` (or `Rejected`).
    `key`: what every prefix key carries (interventions that change prefix tokens make another prefix);
    `steer(row, suffix, item)`: the item with its per-row intervention parameters, or why it has none
    (`forge.runtime.hooks.row_steer`)."""
    for (row, p, index), made in zip(pending, tokens_of):
        iid = row.id if p.suffix is None else f"{row.id}/{p.suffix}"
        if isinstance(made, str):
            yield Rejected(iid, f"{row.where}: {made}")
            continue
        tokens = made.prefix + made.text
        first = max(len(made.prefix), 1)
        targets = () if not with_targets else tuple(tokens[first:]) if made.targets is None else tuple(made.targets)
        tokens = np.asarray(tokens, dtype=np.int32)  # 4 bytes a token while it waits (a list: ~36)
        start = first - 1 if made.target_start is None else made.target_start
        meta = ItemMeta(targets, start, p.label, p.data, row.index)
        prefix_key = made.prefix_key if key is None or made.prefix_key is None else f"{made.prefix_key}|{key}"
        item = Item(iid, len(tokens), prefix_key, len(made.prefix), tokens, meta, index)
        steered = item if steer is None else steer(row, p.suffix, item)
        yield steered if isinstance(steered, Item) else Rejected(iid, f"{row.where}: {steered}")


def sample_output(
    records: Generator[Any, None, None], rows: int, max_seq_len: int | None = None, too_long: str = "skip"
) -> tuple[int, int, int]:
    """(items, own tokens, rows seen) of the first `rows` input rows' items, each counted as
    admission will take it: over `max_seq_len`, skipped or failed (nothing written) or truncated."""
    items = own = seen = 0
    try:
        for record in records:
            if not isinstance(record, Item):
                continue
            if record.meta.row >= rows:
                break
            seen = record.meta.row + 1
            tokens = record.num_tokens
            if max_seq_len is not None and tokens > max_seq_len:
                if too_long != "truncate" or record.prefix_len >= max_seq_len:
                    continue  # skipped, or failed: writes nothing
                tokens = max_seq_len
            items, own = items + 1, own + tokens - record.prefix_len
    finally:
        records.close()
    return items, own, seen
