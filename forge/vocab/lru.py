"""A least-recently-used map bounded by a token count. Plain Python, no torch.

The scheduler uses it to predict what each device's prefix cache holds; the device's
prefix KV cache uses it to hold the tensors. Same policy, same capacity, same access
order per device: the prediction and the real cache agree.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class TokenLRU:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = max(0, int(capacity_tokens))
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.tokens = 0  # tokens held now
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self):
        """The keys held, least recently used first (a live view)."""
        return self._entries.keys()

    def get(self, key: Hashable) -> Any | None:
        """The value for `key` (marking it most recently used), or None; counts a hit or miss."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def can_store(self, tokens: int) -> bool:
        return 0 < tokens <= self.capacity_tokens

    def put(self, key: Hashable, value: Any, tokens: int) -> bool:
        """Store `value` under `key`, evicting least recently used entries to make room.
        A value larger than the whole capacity is not stored (and an older value under the
        same key is dropped, so nothing stale remains). Returns whether it was stored."""
        if key in self._entries:
            self.tokens -= self._entries.pop(key)[1]
        if not self.can_store(tokens):
            return False
        while self.tokens + tokens > self.capacity_tokens:
            _, (_, old) = self._entries.popitem(last=False)
            self.tokens -= old
            self.evictions += 1
        self._entries[key] = (value, tokens)
        self.tokens += tokens
        return True

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
        self.tokens = 0
