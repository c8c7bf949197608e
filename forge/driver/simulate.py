"""Plan bare token geometry on any devices: `forge plan` without a function's input or model.

Model: a `GeometryFunction` hands the engine Items that carry only their token geometry
(lengths and prefixes) and a given memory model, so benchmarks and tests plan synthetic
workloads (the reference workload, heavy tails, 200k items) on simulated devices through the
same admission, scheduler, run loop, simulated executor and ledger as `forge plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from forge.batching.cost import CostModel
from forge.config.modes import Batching
from forge.driver.engine import RunSpec
from forge.driver.report import Report
from forge.errors import ForgeError
from forge.function import Function
from forge.vocab.geometry import Device, Item


class GeometryFunction(Function):
    """Items as given; a memory model as given; nothing runs (plans only)."""

    name = "geometry"

    def __init__(self, items: Iterable[Item], cost: CostModel | None = None):
        self.items = items  # token geometry only (Item.tokens may be None)
        self.cost = cost  # the memory model batching=memory and simulated devices use

    def records(self) -> Iterator[Item]:
        return iter(self.items)

    def open_worker(self, device: Device, cache_tokens: int):
        raise ForgeError("a geometry function only plans: it has no model to run")

    def open_sink(self, store):
        raise ForgeError("a geometry function only plans: it writes no outputs")

    def fingerprint(self) -> dict[str, Any]:
        return {"function": self.name}

    def cost_model(self) -> CostModel | None:
        return self.cost

    def describe(self) -> dict[str, Any]:
        return {"model": "geometry", "input": "items"}


def plan_geometry(
    items: Iterable[Item],
    devices: list[Device],
    mode: str = "memory",
    *,
    cost: CostModel | None = None,
    options: dict[str, Any] | None = None,
    keep_batches: bool = False,
    pm=None,
) -> Report:
    """The plan report of `items` on `devices` under batching `mode` (virtual time). `options`:
    keys of the mode's schema (its packer's `config_schema`: window, cache_tokens, ...); the
    others keep the schema's defaults."""
    from forge.driver.plan import plan
    from forge.pluginmanager import batching_modes, make_plugin_manager

    pm = pm or make_plugin_manager()
    factory = batching_modes(pm).get(mode, (None, None))[0]
    config = dataclasses.asdict(getattr(factory, "config_schema", Batching)(**(options or {})))
    spec = RunSpec(
        function=GeometryFunction(items, cost),
        mode=mode,
        mode_options=config,
        devices=devices,
        window=config["window"],
        cache_tokens=config["cache_tokens"] if config.get("prefix_cache") else 0,  # cacheless modes have neither key
    )
    return plan(spec, pm, keep_batches=keep_batches)
