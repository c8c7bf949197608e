"""Built-in batching modes: item, token, memory."""

from forge.batching import ItemPacker, MemoryPacker, TokenPacker
from forge.hookspecs import hookimpl


@hookimpl
def forge_batching_modes():
    return {"item": ItemPacker, "token": TokenPacker, "memory": MemoryPacker}
