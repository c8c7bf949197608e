"""The prefix KV cache: shared prefixes' keys and values kept on a device, least recently used out,
sized in prefix tokens (the run's batching.cache_tokens). One class for both of its users: the
forward runners' cache (`forge.runtime.forward.causal_lm`) and the decoder's stored prefixes
(`forge.runtime.decoder.engine`).

Plain Python, one job (not thread-safe). Entries are opaque except for their `length` (the
prefix's token count), which is what capacity is measured in, and their keys and values' bytes.
A key is `PrefixKey`: the interventions' tag (None: no steering reaches a prefix token) and the
prefix's identity, so a steered prefix and an unsteered one are never served from each other.

Starts: an entry that carries its `tokens` is also found by its first k x `START_BLOCK` tokens
(`longest_start`), as vLLM finds cached blocks by chained block hashes: a prefix that begins as a
cached one does (a few-shot prompt's shots, then a question of its own) runs only what follows. In a
causal model a token's keys depend only on the tokens before it, so the first n tokens' keys of any
entry that starts with them are theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forge.vocab.lru import TokenLRU

START_BLOCK = 16  # starts are found in whole blocks of this many tokens

#: what a prefix's KV is stored under: a steering tag (the decoder: with what a row's own intervention
#: values change in it, `Sequence.prefix_tag`), and its identity (the decoder: its token ids; the
#: forward runners: the items' `prefix_key`)
PrefixKey = tuple[Any, Any]


@dataclass(slots=True)
class PrefixEntry:
    """One cached prefix: per-layer (key, value) tensors with batch dim 1, and its length.

    `tokens` (the prefix's token ids, CPU) lets a user of the cache check that a key still
    means the same tokens; `last_hidden` ({layer: hidden state of the prefix's last token})
    serves items whose whole sequence is the prefix; `last_state` (the base decoder's final
    state at the prefix's last position, on the device) predicts the token after the prefix,
    so scoring a text's first token needs no shifted layout. None is required by the cache.
    The tensors are never modified after they are stored: users build new objects from them
    (the decoder may move them into a stacked tensor it reads, `forge.runtime.forward.shared_prefix.stack`,
    the entry's list then holding views of the same values).
    """

    key_values: list[tuple[Any, Any]]
    length: int
    tokens: Any = None
    last_hidden: dict[int, Any] = field(default_factory=dict)
    last_state: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.key_values for t in kv)


class PrefixCache(TokenLRU):
    """LRU over `PrefixKey` -> PrefixEntry, holding at most `capacity_tokens` prefix tokens and, when
    `max_bytes` is given, at most that many bytes of keys and values.

    capacity_tokens <= 0 disables the cache: `put` never stores and `get` always misses. Without
    `keep` its policy is `TokenLRU`'s, which the scheduler uses to predict hits. `put`'s `keep`
    (the decoder's running block's prefixes: its prompts start after them) are never put out, even
    over the bounds; nor is the entry being put.
    """

    def __init__(self, capacity_tokens: int, max_bytes: int | None = None):
        super().__init__(capacity_tokens)
        self.max_bytes = max_bytes
        self.bytes = 0  # what the stored keys and values hold
        # (tag, digest of an entry's first k blocks) -> its key; stale once the entry is out (checked on use)
        self._starts: dict[tuple[str | None, bytes], PrefixKey] = {}

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def peek(self, key: PrefixKey) -> PrefixEntry | None:
        """The entry under `key`, or None, leaving its place in the LRU order and the counts alone."""
        held = self._entries.get(key)
        return None if held is None else held[0]

    def put(self, key: PrefixKey, entry: PrefixEntry, keep: Collection[PrefixKey] = ()) -> bool:  # type: ignore[override]
        """Store `entry`, least recently used others out (not those in `keep`) while over a bound.
        One longer than the whole capacity is not stored (an older one under `key` is dropped).
        Returns whether it was stored."""
        tokens, size = int(entry.length), entry.nbytes
        if key in self._entries:
            old, n = self._entries.pop(key)
            self.tokens, self.bytes = self.tokens - n, self.bytes - old.nbytes
        if not self.can_store(tokens):
            return False
        for old_key in [k for k in self._entries if k not in keep]:  # least recently used first
            if not self._over(tokens, size):
                break
            old, n = self._entries.pop(old_key)
            self.tokens, self.bytes = self.tokens - n, self.bytes - old.nbytes
            self.evictions += 1
        self._entries[key] = (entry, tokens)
        self.tokens, self.bytes = self.tokens + tokens, self.bytes + size
        if entry.tokens is not None:
            if len(self._starts) > 4 * max(self.capacity_tokens, 1) // START_BLOCK:  # drop the stale ones
                self._starts = {s: k for s, k in self._starts.items() if k in self._entries}
            self._starts.update(((key[0], d), key) for d in block_digests(entry.tokens))
        return True

    def longest_start(self, tag: str | None, tokens: Any, most: int) -> tuple[PrefixEntry, int] | None:
        """The held entry (under `tag`) that starts with the most whole blocks of `tokens`, at most `most`
        tokens, and how many: (entry, n), the entry marked used; None when none starts with a block."""
        digests = block_digests(tokens[: max(0, most)])
        for k in range(len(digests) - 1, -1, -1):
            key = self._starts.get((tag, digests[k]))
            entry = None if key is None else self.peek(key)
            n = (k + 1) * START_BLOCK
            if entry is None or entry.tokens is None or entry.length < n:
                continue
            if np.array_equal(np.asarray(entry.tokens[:n]), np.asarray(tokens[:n])):  # not a digest collision
                self._entries.move_to_end(key)
                return entry, n
        return None

    def _over(self, tokens: int, size: int) -> bool:
        over_bytes = self.max_bytes is not None and self.bytes + size > self.max_bytes
        return self.tokens + tokens > self.capacity_tokens or over_bytes

    def clear(self) -> None:
        super().clear()
        self.bytes = 0
        self._starts = {}

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self),
            "tokens": self.tokens,
            "capacity_tokens": self.capacity_tokens,
        }


def block_digests(tokens: Any) -> list[bytes]:
    """Digests of `tokens`' first k whole blocks, k = 1, 2, ... (each block's chained on the one before)."""
    ids = np.asarray(tokens, dtype=np.int64)
    h, out = hashlib.sha1(), []
    for k in range(len(ids) // START_BLOCK):
        h.update(ids[k * START_BLOCK : (k + 1) * START_BLOCK].tobytes())
        out.append(h.digest())
    return out
