"""A tree batch's root: the leading tokens that every prefix in it shares, run once and kept in the
device's prefix cache, so that the tree rows hold only what differs.

Model: in a few-shot evaluation each question's context is the same shots followed by the question,
and a question's choices share that context (a prefix group). Tree rows (`Batch.tree`) put each
group's prefix in a row once; without a root each row would still run the shots again. The root is
the longest common start of the batch's prefixes, cut down to a multiple of `ROOT_BLOCK` tokens (so
that batches whose prefixes agree a few tokens further still meet the same cached root) and at
least one token short of every prefix (a prefix's last token stays in its row, whose state items
read). Under `ROOT_MIN_TOKENS` nothing is held apart. A root the cache does not hold runs after the
longest start of it the cache does hold (`PrefixCache.longest_start`: an earlier root a block
shorter, or a split prefix that begins with the same shots), so it too runs only what is new.

Exact: in a causal model a token's keys and values depend only on the tokens before it, so the
root's, run alone, are those of every prefix that starts with it; the rows run on them as rows
run on a split prefix (every query sees the root's keys under the same 4D masks, windows included).
The packer knows nothing of it: it sizes the batch with each prefix whole in its rows, an upper
bound of what runs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from forge.vocab.geometry import Item

ROOT_BLOCK = 16  # a root's length is a multiple of this many tokens
ROOT_MIN_TOKENS = 32  # a shorter common start stays in the rows


def root_length(items: list[Item], seqs: list[torch.Tensor]) -> int:
    """The leading tokens every item's prefix shares, cut to a multiple of ROOT_BLOCK and short of
    each prefix's last token; 0 when that is under ROOT_MIN_TOKENS or an item has no prefix."""
    if not items or min(it.prefix_len for it in items) <= ROOT_MIN_TOKENS:
        return 0
    n = min(it.prefix_len for it in items) - 1
    first = seqs[0][:n]
    seen = {items[0].prefix_key}
    for it, seq in zip(items, seqs):
        if it.prefix_key in seen:
            continue
        seen.add(it.prefix_key)
        differ = torch.nonzero(first[:n] != seq[:n])
        if differ.numel():
            n = int(differ[0, 0])
            if n < ROOT_MIN_TOKENS:
                return 0
    n -= n % ROOT_BLOCK
    return n if n >= ROOT_MIN_TOKENS else 0


def root_id(tokens: torch.Tensor) -> tuple[str, str]:
    """The identity a root is cached under: its tokens' digest (never equal to an item's prefix key)."""
    return ("root", hashlib.sha1(np.asarray(tokens.cpu(), np.int64).tobytes()).hexdigest()[:16])
