"""Batching modes: packers that cut batches from a window of items, one per mode."""

from forge.batching.base import Chunk, Cut, GroupInfo, Packer, Urgency, create_packer
from forge.batching.cost import CostModel
from forge.batching.item import ItemPacker
from forge.batching.memory import MemoryPacker
from forge.batching.token import TokenPacker
from forge.vocab.geometry import NO_PREFIX

__all__ = [
    "NO_PREFIX",
    "Chunk",
    "CostModel",
    "Cut",
    "GroupInfo",
    "ItemPacker",
    "MemoryPacker",
    "Packer",
    "TokenPacker",
    "Urgency",
    "create_packer",
]
