"""How a generated token is chosen: greedy, or drawn from the row's own random stream.

A row's stream is seeded by (seed, the row's id) alone, and takes one draw per token, so a sampled
row's text does not depend on its batch, its neighbours, the step budget or a resume.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen: greedy when temperature is 0; else from the softmax of logits/temperature,
    cut to the top_k (0: all) and the top_p mass, by one draw of the row's own stream per token."""

    # no defaults here: generate's config schema (SamplingConfig) is their one home
    temperature: float
    top_p: float
    top_k: int
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stream(self, key: str) -> np.random.Generator:
        """The row's stream: from (seed, key) alone, so its draws do not depend on its batch."""
        return np.random.Generator(np.random.PCG64([int(self.seed), zlib.crc32(key.encode())]))

    def draw(self, logits: torch.Tensor, rng: np.random.Generator) -> int:
        x = logits.double().cpu().numpy() / self.temperature
        if 0 < self.top_k < len(x):
            x = np.where(x >= np.partition(x, -self.top_k)[-self.top_k], x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        at = int(np.searchsorted(np.cumsum(p), rng.random(), side="right"))
        return min(at, len(p) - 1)
