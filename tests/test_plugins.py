"""Plugins: built-ins come from entry points; a third-party mode plugs in the same way."""

from conftest import spec_for
from forge.driver.plan import plan
from forge.pluginmanager import batching_modes, make_plugin_manager


def test_builtins_register_through_entry_points(pm):
    modes = batching_modes(pm)
    assert {name: plugin for name, (_, plugin) in modes.items() if plugin == "batching"} == {
        "item": "batching",
        "token": "batching",
        "memory": "batching",
    }  # installed plugins may add more
    assert {"ledger", "progress", "batching"} <= {pm.get_name(p) for p in pm.get_plugins()}


def test_without_entry_points_there_are_no_modes():
    assert batching_modes(make_plugin_manager(load_entry_points=False)) == {}


def test_a_third_party_mode_plans(pm):
    import examples.shortest_first_plugin as plugin

    pm.register(plugin, name="shortest")
    spec = spec_for("input.limit=100")
    spec.mode, spec.mode_options = "shortest", {"batch_size": 8}
    report = plan(spec, pm, keep_batches=True)
    assert report["batching"] == "shortest" and report["balanced"]
    lengths = [b.padded_len for b in report.plan.kept_batches]
    assert lengths == sorted(lengths)


def test_every_hookspec_is_typed_and_documents_its_parameters():
    import inspect
    import typing

    import forge.batching.base
    import forge.executors.base
    import forge.function
    import forge.hookspecs
    import forge.tracker
    import forge.vocab.geometry
    import forge.vocab.records

    names = {
        **vars(forge.hookspecs),
        **vars(forge.vocab.geometry),
        **vars(forge.vocab.records),
        "Packer": forge.batching.base.Packer,
        "Executor": forge.executors.base.Executor,
        "Function": forge.function.Function,
        "Tracker": forge.tracker.Tracker,
    }
    specs = [f for name, f in vars(forge.hookspecs).items() if name.startswith("forge_") and callable(f)]
    assert len(specs) >= 20
    for spec in specs:
        hints = typing.get_type_hints(spec, names)  # every annotation resolves
        params = inspect.signature(spec).parameters
        assert set(hints) == {*params, "return"}, spec.__name__
        for param in params:
            assert f":param {param}:" in (spec.__doc__ or ""), (spec.__name__, param)
