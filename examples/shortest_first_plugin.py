"""A third-party batching mode in a dozen lines: `shortest` cuts item batches shortest first.

Register it from your package's pyproject.toml:

    [project.entry-points.forge]
    shortest = "examples.shortest_first_plugin"

add `conf/batching/shortest.yaml` (`defaults: [/schema_batching/shortest@_here_, _self_]`: the keys and
defaults of the mode's schema, `ItemPacker`'s `forge.config.modes.ItemBatching`, with `mode: shortest`)
in a directory you pass with `--config-dir`, and run `forge run --config-dir DIR batching=shortest`
(or ship the YAML in your package and offer it with `forge_config_searchpath`, as
examples/forge-plugin-example does).
"""

from forge import hookimpl
from forge.batching import ItemPacker


class ShortestFirst(ItemPacker):
    def sort_key(self, lengths):
        return lengths  # lower runs first


@hookimpl
def forge_batching_modes():
    return {"shortest": ShortestFirst}
