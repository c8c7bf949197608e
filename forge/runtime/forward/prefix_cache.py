"""A per-device LRU cache of shared-prefix KV states, sized in tokens.

Plain Python, one job (not thread-safe). Entries are opaque except for their `length`
(the prefix's token count), which is what capacity is measured in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.vocab.lru import TokenLRU


@dataclass(slots=True)
class PrefixEntry:
    """One cached prefix: per-layer (key, value) tensors with batch dim 1, and its length.

    `tokens` (the prefix's token ids, CPU) lets a user of the cache check that a key still
    means the same tokens; `last_hidden` ({layer: hidden state of the prefix's last token})
    serves items whose whole sequence is the prefix; `last_state` (the base decoder's final
    state at the prefix's last position, on the device) predicts the token after the prefix,
    so scoring a text's first token needs no shifted layout. None is required by the cache.
    The tensors are never modified after they are stored: users build new objects from them.
    """

    key_values: list[tuple[Any, Any]]
    length: int
    tokens: Any = None
    last_hidden: dict[int, Any] = field(default_factory=dict)
    last_state: Any = None


class PrefixCache(TokenLRU):
    """LRU over prefix_key -> PrefixEntry, holding at most `capacity_tokens` prefix tokens.

    capacity_tokens <= 0 disables the cache: `put` never stores and `get` always misses.
    The scheduler predicts hits with a `TokenLRU` of the same capacity and policy.
    """

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def put(self, key: Any, entry: PrefixEntry) -> bool:  # type: ignore[override]
        return super().put(key, entry, int(entry.length))

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self),
            "tokens": self.tokens,
            "capacity_tokens": self.capacity_tokens,
        }
