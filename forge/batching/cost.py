"""What one forward step costs in bytes: a model's memory model, as plain numbers (no torch).

A step's memory is the resident weights plus, per row, what the forward pass holds for its
padded tokens (hidden states kept for output, transient projections), its attention scores
(padded_len x (prefix + padded_len)) and, behind a shared prefix, its KV cache (the expanded
prefix and its own tokens), plus the prefix's own entry once. The `memory` mode's packer
(`forge.batching.memory`) sizes batches with it; models measure it (`forge.runtime.cost.memory_fit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.vocab.geometry import row_scores

GB = 1 << 30


@dataclass(frozen=True, slots=True)
class CostModel:
    """Bytes one forward step needs, from a model's shape or measured. Plain numbers; no torch."""

    weight_bytes: int  # resident parameters (and any fixed overhead)
    bytes_per_token: float  # per padded row slot: kept hidden states + peak transient activations + KV
    bytes_per_score: float  # per attention score (query x key pair), all heads
    kv_bytes_per_token: float  # per token a row's KV cache holds: the expanded prefix + its own, when it has a prefix
    prefix_bytes_per_token: float = 0.0  # per prefix token, once per batch (its cached entry or its own pass)
    margin: float = 0.0  # the activation terms above were raised by this share over the measured fit

    def true_bytes(self, rows: int, padded_len: int, prefix_len: int = 0) -> int:
        """The measured fit itself, without the safety margin: what a simulated device holds."""
        step = self.step_bytes(rows, padded_len, prefix_len)
        return int(self.weight_bytes + (step - self.weight_bytes) / (1 + self.margin))

    def step_bytes(self, rows: int, padded_len: int, prefix_len: int = 0) -> int:
        return int(self.weight_bytes + self._once(prefix_len) + rows * self._per_row(padded_len, prefix_len))

    def _once(self, prefix_len: int) -> float:
        return prefix_len * self.prefix_bytes_per_token

    def _per_row(self, padded_len: int, prefix_len: int) -> float:
        return (
            padded_len * self.bytes_per_token
            + row_scores(padded_len, prefix_len) * self.bytes_per_score
            + (prefix_len + padded_len if prefix_len else 0) * self.kv_bytes_per_token
        )

    def max_rows(self, budget_bytes: int, padded_len: int, prefix_len: int = 0) -> int:
        """Rows of `padded_len` slots that fit `budget_bytes`."""
        room = budget_bytes - self.weight_bytes - self._once(prefix_len)
        per_row = self._per_row(padded_len, prefix_len)
        if per_row <= 0:
            return 1 << 30 if room >= 0 else 0
        return max(0, int(room // per_row))

    @classmethod
    def from_shape(
        cls,
        *,
        num_params: int,
        hidden: int,
        layers: int,
        heads: int,
        kv_heads: int,
        intermediate: int,
        dtype_bytes: int,
    ) -> CostModel:
        head_dim = hidden // heads
        kv_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
        return cls(
            weight_bytes=num_params * dtype_bytes,
            # hidden states of every layer (output_hidden_states) + peak MLP/attention transients
            bytes_per_token=dtype_bytes * (hidden * (layers + 1) + 3 * intermediate + 4 * hidden),
            bytes_per_score=2 * heads * dtype_bytes,  # scores and their softmax
            kv_bytes_per_token=kv_per_token,
        )
