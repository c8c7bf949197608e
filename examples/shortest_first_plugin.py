"""A third-party batching mode in a dozen lines: `shortest` cuts item batches shortest first.

Register it from your package's pyproject.toml:

    [project.entry-points.forge]
    shortest = "examples.shortest_first_plugin"

add `conf/batching/shortest.yaml` (`mode: shortest`, `window: 65536`, `batch_size: 32`) in a
directory you pass with `--config-dir`, and run `forge run --config-dir DIR batching=shortest`.
"""

from forge import hookimpl
from forge.batching import ItemPacker


class ShortestFirst(ItemPacker):
    def add(self, item):
        super().add(item)
        self._sorted = False

    def cut(self, key, device, drain):
        if not self._sorted:
            self._queue = type(self._queue)(sorted(self._queue, key=lambda it: it.num_tokens))
            self._sorted = True
        return super().cut(key, device, drain)


@hookimpl
def forge_batching_modes():
    return {"shortest": ShortestFirst}
