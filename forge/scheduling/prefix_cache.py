"""The predicted prefix caches: which prefixes each device's cache holds, as the scheduler sees it.

Model: a device keeps the KV of its recent prefixes in an LRU bounded by `cache_tokens`
prefix tokens (`forge.vocab.lru.TokenLRU`). The scheduler keeps the same LRU, with the same policy
and capacity, per device, and routes every batch with a split prefix through it in the order
the device will run them, so a predicted hit is the hit the device will see. A miss is
counted where it is predicted (and uncounted when the batch does not run there after all);
a lost worker's cache is forgotten, as its successor starts empty. Keys are prefix codes, as
the packer's groups are.
"""

from __future__ import annotations

from collections.abc import KeysView

from forge.vocab.lru import TokenLRU


class PrefixCacheModel:
    def __init__(self, device_names: list[str], cache_tokens: int):
        self.cache_tokens = cache_tokens  # per-device capacity, in prefix tokens
        self.caches = {name: TokenLRU(cache_tokens) for name in device_names}  # device -> predicted cache
        self.misses = {name: 0 for name in device_names}  # device -> predicted misses (prefix computed)

    def held(self, name: str) -> KeysView:
        """The prefix codes `name`'s cache holds (a live view)."""
        return self.caches[name].keys()

    def held_elsewhere(self, name: str) -> set[int]:
        """The prefix codes any other device's cache holds."""
        return set().union(*(c.keys() for other, c in self.caches.items() if other != name))

    def others(self, name: str) -> list[tuple[str, KeysView]]:
        """(device, codes its cache holds) for every other device, in device order."""
        return [(other, c.keys()) for other, c in self.caches.items() if other != name]

    def route(self, name: str, code: int, prefix_len: int) -> bool:
        """A batch behind prefix `code` runs on `name`: whether its cache holds the prefix (a
        predicted hit); on a miss the miss is counted and the prefix enters the cache."""
        cache = self.caches[name]
        hit = cache.get(code) is not None
        if not hit:
            self.misses[name] += 1
            cache.put(code, True, prefix_len)
        return hit

    def unroute_miss(self, name: str) -> None:
        """A batch predicted to miss on `name` does not run there after all."""
        self.misses[name] -= 1

    def forget(self, name: str) -> None:
        """`name`'s worker was lost: its successor starts with an empty cache."""
        self.caches[name] = TokenLRU(self.cache_tokens)
