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

from forge.batching.cost import GB, CostModel
from forge.batching.token import TokenPacker
from forge.config.modes import MemoryBatching
from forge.errors import ForgeError
from forge.vocab.geometry import Batch, Device


class MemoryPacker(TokenPacker):
    config_schema = MemoryBatching
    cost_model: CostModel  # always set: a memory packer is never without its model

    def __init__(self, config: MemoryBatching | None = None, cost_model: CostModel | None = None):
        if cost_model is None:
            raise ForgeError("batching=memory needs a cost model; the function did not provide one")
        config = config if config is not None else MemoryBatching()  # None: the schema's defaults
        super().__init__(config)
        self.cost_model = cost_model
        gb = config.default_memory_gb
        self.default_memory_bytes = int(gb * GB) if gb else None

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
