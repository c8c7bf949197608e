"""Devices: every local CUDA device (or the CPU), or an inventory from config.

An inventory entry (docs/devices.md):

    - name: cuda:0            # unique name used in reports
      device: cuda:0          # torch device the worker uses (default: the name)
      limits: {max_batch_tokens: 16384, max_rows: 256, max_seq_len: 4096, pad_multiple: 8}
      memory_gb: 16           # optional: byte budget for batching=memory
      batch_overhead_tokens: 256  # optional: per-step cost, calibrated per device

A simulated device (`forge plan` only: no model, no sleeping, virtual time) adds a `sim`
block, its step time in seconds `a + b x tokens + c x scores` (see `forge.vocab.geometry.StepTime`;
`forge calibrate` prints one measured on a real device), and needs no `device`:

    - name: card16
      memory_gb: 16
      sim: {seconds_per_step: 0.04, seconds_per_slot: 2.0e-4, seconds_per_score: 1.0e-8}

Its `batch_overhead_tokens` defaults to a / b.

A device group (`forge.config.groups`) is one entry whose `devices` hold one model together,
split in contiguous stages by `forge.runtime.placement.device_map`; `memory_gb` and `sim` then take one
value per member (or one for all), and `split: {offload: cpu|disk|null, link_gb_per_s: 16}`
says whether layers no member holds may go to the CPU or disk (null, the default: refused):

    - {name: pair, devices: [cuda:0, cuda:1], memory_gb: [40, 40], split: {offload: null}}

The devices config's top-level `split: auto` makes every device discovered or listed one group.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from forge.config.groups import group_from, split_auto
from forge.errors import ForgeError
from forge.vocab.geometry import Device, Limits, StepTime

GB = 1 << 30
LIMIT_KEYS = ("max_batch_tokens", "max_rows", "max_seq_len", "pad_multiple")
ENTRY_KEYS = {"name", "device", "devices", "limits", "memory_gb", "batch_overhead_tokens", "sim", "split"}
SIM_KEYS = ("seconds_per_step", "seconds_per_slot", "seconds_per_score")


def step_time_from(spec: Any, where: str) -> StepTime:
    """A `sim` block: the simulated device's step time."""
    if not isinstance(spec, Mapping):
        raise ForgeError(f"{where}: sim must be a mapping of {', '.join(SIM_KEYS)}")
    unknown = set(spec) - set(SIM_KEYS)
    if unknown:
        raise ForgeError(f"{where}: unknown key(s) {sorted(unknown)}; a sim block has {', '.join(SIM_KEYS)}")
    missing = [k for k in SIM_KEYS[:2] if spec.get(k) is None]
    if missing:
        raise ForgeError(f"{where}: missing {', '.join(missing)} (seconds; `forge calibrate` measures them)")
    try:
        return StepTime(**{k: spec[k] for k in SIM_KEYS if spec.get(k) is not None})
    except ForgeError as exc:
        raise ForgeError(f"{where}: {exc}") from None


def limits_from(spec: Mapping[str, Any], where: str) -> Limits:
    unknown = set(spec) - set(LIMIT_KEYS)
    if unknown:
        raise ForgeError(f"{where}: unknown limit(s) {sorted(unknown)}; the limits are {', '.join(LIMIT_KEYS)}")
    missing = [k for k in LIMIT_KEYS[:3] if spec.get(k) is None]
    if missing:
        raise ForgeError(f"{where}: missing {', '.join(missing)}")
    try:
        return Limits(**{k: spec[k] for k in LIMIT_KEYS if spec.get(k) is not None})
    except ForgeError as exc:
        raise ForgeError(f"{where}: {exc}") from None


def discover(limits: Limits, memory_fraction: float, cpu_memory_gb: float | None = None) -> list[Device]:
    """Every local CUDA device, each with `limits`; the CPU when there is none.

    A CUDA device's memory budget is its free memory now x `memory_fraction` (what other
    processes hold is not ours to plan for).
    """
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        torch, n = None, 0
    if n:
        return [
            Device(
                name=f"cuda:{i}",
                limits=limits,
                torch_device=f"cuda:{i}",
                memory_bytes=int(torch.cuda.mem_get_info(i)[0] * memory_fraction),  # free now, not total
            )
            for i in range(n)
        ]
    if cpu_memory_gb is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = int(total * memory_fraction)
    else:
        memory = int(cpu_memory_gb * GB)
    return [Device(name="cpu", limits=limits, torch_device="cpu", memory_bytes=memory)]


def _number(entry: Mapping[str, Any], key: str, where: str, *, integer: bool = False, positive: bool = True) -> Any:
    """An inventory entry's numeric field: None when absent, else a finite number in range."""
    value = entry.get(key)
    if value is None:
        return None
    kind = "integer" if integer else "number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ForgeError(
            f"{where}.{key}={value!r}: must be a {'positive' if positive else 'non-negative'} {kind}; "
            f"fix it in the devices config or leave it out"
        )
    return value


def from_inventory(entries: Any, default_limits: Mapping[str, Any] | None) -> list[Device]:
    if not isinstance(entries, (list, tuple)):
        raise ForgeError(f"devices.inventory must be a list of devices (- name: ...), got a {type(entries).__name__}")
    if default_limits is not None and not isinstance(default_limits, Mapping):
        raise ForgeError(f"devices.limits must be a mapping of {', '.join(LIMIT_KEYS)}")
    devices, names = [], set()
    for i, entry in enumerate(entries):
        where = f"devices.inventory[{i}]"
        if not isinstance(entry, Mapping):
            raise ForgeError(f"{where}: a device is a mapping (name: ..., limits: ...), got {entry!r}")
        name = entry.get("name")
        if not name or not isinstance(name, str):
            raise ForgeError(f"{where}: every device needs a name (a non-empty string)")
        if name in names:
            raise ForgeError(f"{where}: device name {name!r} is used twice; names must be unique")
        names.add(name)
        unknown = set(entry) - ENTRY_KEYS
        if unknown:
            raise ForgeError(
                f"{where} ({name}): unknown key(s) {sorted(unknown)}; an entry has {', '.join(sorted(ENTRY_KEYS))}"
            )
        where = f"{where} ({name})"
        if entry.get("device") is not None and not isinstance(entry["device"], str):
            raise ForgeError(f"{where}.device={entry['device']!r}: must be a torch device name such as cuda:0 or cpu")
        if entry.get("limits") is not None and not isinstance(entry["limits"], Mapping):
            raise ForgeError(f"{where}.limits must be a mapping of {', '.join(LIMIT_KEYS)}")
        spec = dict(default_limits or {})
        spec.update(entry.get("limits") or {})
        if entry.get("devices") is not None:  # a device group (forge.config.groups)
            overhead = _number(entry, "batch_overhead_tokens", where, integer=True, positive=False)
            devices.append(group_from(entry, limits_from(spec, f"{where}.limits"), overhead, where, step_time_from))
            continue
        if entry.get("split") is not None:
            raise ForgeError(f"{where}.split: only a device group splits; list its devices (devices: [cuda:0, cuda:1])")
        memory_gb = _number(entry, "memory_gb", where)
        sim = step_time_from(entry["sim"], f"{where}.sim") if entry.get("sim") is not None else None
        overhead = _number(entry, "batch_overhead_tokens", where, integer=True, positive=False)
        if overhead is None and sim is not None:
            overhead = sim.overhead_tokens
        devices.append(
            Device(
                name=name,
                limits=limits_from(spec, f"{where}.limits"),
                torch_device=entry.get("device") or ("sim" if sim is not None else name),
                memory_bytes=int(memory_gb * GB) if memory_gb else None,
                batch_overhead_tokens=overhead,
                sim=sim,
            )
        )
    return devices


def resolve_devices(cfg: Mapping[str, Any]) -> list[Device]:
    """Devices from a `devices` config: the inventory when it lists any, else discovery. A key the
    config lacks (a YAML read as it is) takes its default from the schema, `forge.config.schema.Devices`."""
    from forge.config.nodes import defaults_of
    from forge.config.schema import Devices

    cfg = {**defaults_of(Devices), **cfg}
    inventory = cfg["inventory"] or []
    if inventory or not isinstance(inventory, (list, tuple)):
        return split_auto(from_inventory(inventory, cfg["limits"]), cfg["split"])
    if not cfg["discover"]:
        raise ForgeError("devices: discover is false and the inventory is empty; list at least one device")
    found = discover(
        limits_from(cfg["limits"] or {}, "devices.limits"),
        memory_fraction=cfg["memory_fraction"],
        cpu_memory_gb=cfg["cpu_memory_gb"],
    )
    return split_auto(found, cfg["split"])
