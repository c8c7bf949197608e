"""The plugin module named by the `forge` entry point: four hooks, no heavy imports."""

from forge import hookimpl


@hookimpl
def forge_functions():
    # an import path: the function's module is imported only when it runs
    return {"token_norms": "forge_plugin_example.token_norms:TokenNorms"}


@hookimpl
def forge_batching_modes():
    from forge_plugin_example.sorted_mode import SortedPacker

    return {"sorted": SortedPacker}


@hookimpl
def forge_trackers():
    return {"jsonl": "forge_plugin_example.jsonl_tracker:JsonlTracker"}


@hookimpl
def forge_config_searchpath():
    return "pkg://forge_plugin_example.conf"
