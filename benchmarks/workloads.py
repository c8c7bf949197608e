"""Reference workloads, defined in code with fixed seeds (issue: token-aware packing).

reference(): 3,000 prompts, 12 prefixes with token lengths spread evenly over 64..384,
statement lengths lognormal with median 40 tokens clipped to 4..400, arrival shuffled.
"""

from __future__ import annotations

import numpy as np

from forge.core.geometry import Item


def geometry(n: int = 3000, n_prefixes: int = 12, seed: int = 0):
    """(prefix index per item, prefix lengths, suffix lengths) as numpy arrays."""
    rng = np.random.default_rng(seed)
    prefix_lens = np.linspace(64, 384, n_prefixes).round().astype(np.int64)
    which = rng.integers(0, n_prefixes, n)
    suffix = np.clip(np.round(rng.lognormal(np.log(40), 0.75, n)), 4, 400).astype(np.int64)
    order = rng.permutation(n)  # arrival order: shuffled
    return which[order], prefix_lens, suffix[order]


def items(n: int = 3000, n_prefixes: int = 12, seed: int = 0, vocab: int | None = None, bos: int = 1) -> list[Item]:
    """Items of the workload; with `vocab`, random token ids (prefix ids fixed per prefix)."""
    which, prefix_lens, suffix = geometry(n, n_prefixes, seed)
    rng = np.random.default_rng(seed + 1)
    prefixes = None
    if vocab is not None:
        prefixes = [[bos] + rng.integers(4, vocab, int(p) - 1).tolist() for p in prefix_lens]
    keys = [f"prefix{k}" for k in range(n_prefixes)]  # a producer names each prefix once
    out = []
    for i, (k, s) in enumerate(zip(which.tolist(), suffix.tolist())):
        p = int(prefix_lens[k])
        tokens = prefixes[k] + rng.integers(4, vocab, s).tolist() if prefixes is not None else None
        out.append(Item(str(i), p + s, keys[k], p, tokens, (i, None)))
    return out
