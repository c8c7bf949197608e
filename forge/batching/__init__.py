"""Batching modes: packers that cut batches from a window of items, one per mode."""

from forge.batching.base import GroupInfo, Packer, create_packer
from forge.batching.item import ItemPacker
from forge.batching.memory import CostModel, MemoryPacker
from forge.batching.token import TokenPacker

__all__ = ["CostModel", "GroupInfo", "ItemPacker", "MemoryPacker", "Packer", "TokenPacker", "create_packer"]
