"""`memory` mode: token-mode grouping, with batch size bounded by a device's byte budget.

Model: a step's memory is the resident weights plus, per row, what the forward pass
holds for its padded tokens (hidden states kept for output, transient projections),
its attention scores (padded_len x (prefix + padded_len)) and, behind a shared prefix,
its KV cache (the expanded prefix and its own tokens), plus the prefix's own entry once.
`CostModel` turns a model's shape into those coefficients; the packer then allows
as many rows as `device.memory_bytes` holds, within the four limits. A 16 GB and a
32 GB card draining one backlog each get the largest batches they can hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.batching.token import TokenPacker
from forge.core.geometry import Batch, Device, row_scores
from forge.errors import ForgeError

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


class MemoryPacker(TokenPacker):
    cost_model: CostModel  # always set: a memory packer is never without its model

    def __init__(self, cost_model: CostModel | None = None, default_memory_bytes: int | None = None, **token_options):
        if cost_model is None:
            raise ForgeError("batching=memory needs a cost model; the function did not provide one")
        super().__init__(**token_options)
        self.cost_model = cost_model
        self.default_memory_bytes = default_memory_bytes

    def budget(self, device: Device) -> int:
        budget = device.memory_bytes or self.default_memory_bytes
        if not budget:
            raise ForgeError(
                f"batching=memory: device {device.name} has no memory budget; set memory_gb on its "
                "devices entry or batching.default_memory_gb"
            )
        return budget

    def profile(self, device: Device) -> tuple:
        return *super().profile(device), self.budget(device)  # plans here also read the byte budget

    def check_device(self, device: Device) -> None:
        budget = self.budget(device)
        if budget <= self.cost_model.weight_bytes:
            raise ForgeError(
                f"batching=memory: device {device.name} has {budget / GB:.3f} GB, not more than the "
                f"model's {self.cost_model.weight_bytes / GB:.3f} GB of weights; raise its memory_gb"
            )

    def predicted_bytes(self, batch: Batch) -> int:
        """The cost model's peak for a batch as cut (for the report)."""
        prefix = batch.prefix_len if batch.split_prefix else 0
        return self.cost_model.step_bytes(batch.num_rows, batch.padded_len, prefix)

    def row_cap(self, padded_len: int, prefix_len: int, device: Device) -> int:
        rows = self.cost_model.max_rows(self.budget(device), padded_len, prefix_len)
        return min(super().row_cap(padded_len, prefix_len, device), rows)
