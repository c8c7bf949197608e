"""A per-device LRU cache of shared-prefix KV states, sized in tokens.

Plain Python, one job (not thread-safe). Entries are opaque except for their `length`
(the prefix's token count), which is what capacity is measured in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PrefixEntry:
    """One cached prefix: per-layer (key, value) tensors with batch dim 1, and its length.

    `tokens` (the prefix's token ids, CPU) lets a user of the cache check that a key still
    means the same tokens; `last_hidden` ({layer: hidden state of the prefix's last token})
    serves items whose whole sequence is the prefix. Neither is required by the cache.
    The tensors are never modified after they are stored: users build new objects from them.
    """

    key_values: list[tuple[Any, Any]]
    length: int
    tokens: Any = None
    last_hidden: dict[int, Any] = field(default_factory=dict)


class PrefixCache:
    """LRU over prefix_key -> entry, holding at most `capacity_tokens` prefix tokens.

    capacity_tokens <= 0 disables the cache: `put` never stores and `get` always misses.
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = int(capacity_tokens)
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    @property
    def tokens(self) -> int:
        """Prefix tokens currently held."""
        return self._tokens

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> Any | None:
        """The entry for `key` (now the most recently used), or None. Counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: Any, entry: Any) -> bool:
        """Store `entry` as the most recently used; evict LRU entries until it fits.

        Returns whether it was stored. An entry longer than the capacity is not stored
        (and any older entry under the same key is dropped, so nothing stale remains).
        """
        size = int(entry.length)
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= int(old.length)
        if not self.enabled or size > self.capacity_tokens:
            return False
        while self._entries and self._tokens + size > self.capacity_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= int(evicted.length)
            self.evictions += 1
        self._entries[key] = entry
        self._tokens += size
        return True

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
        self._tokens = 0

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "tokens": self._tokens,
            "capacity_tokens": self.capacity_tokens,
        }
