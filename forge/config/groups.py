"""Device groups: one inventory entry whose devices hold one model together (docs/devices.md).

A group entry lists its members' torch devices in stage order; `memory_gb` is each member's
budget (one number for all, or one per member), `sim` each member's step time for the whole
model (one block for all, or one per member: a stage runs its share of it), and `split` how the
model may be split:

    - name: pair
      devices: [cuda:0, cuda:1]      # members, in stage order (a simulated group names what it simulates)
      memory_gb: [40, 40]            # per member (or one number for all)
      split: {offload: null}         # cpu | disk: where layers go that no member holds; null: refuse
      sim: {seconds_per_step: 0.1, seconds_per_slot: 1.0e-3}   # forge plan only

`split` keys: `offload` (null, cpu or disk; default null: a model the members cannot hold is
refused, with the reason), `link_gb_per_s` (bandwidth between stages and to CPU offload, for the
plan's step cost; default 16). A devices config's top-level `split: auto` makes every device it
discovers or lists one group instead. Which layers each member holds is decided per function by
`forge.runtime.placement.device_map` when the run is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from forge.errors import ForgeError
from forge.vocab.geometry import Device, Limits, Member

GB = 1 << 30
SPLIT_KEYS = ("offload", "link_gb_per_s")
OFFLOADS = ("cpu", "disk")
DEFAULT_LINK_GB_PER_S = 16.0  # PCIe 4.0 x16, as it is had in practice


def split_from(spec: Any, where: str) -> tuple[str | None, float]:
    """A `split` block: (offload target or None, link bandwidth in GB/s)."""
    if spec is None:
        return None, DEFAULT_LINK_GB_PER_S
    if not isinstance(spec, Mapping):
        raise ForgeError(
            f"{where}.split={spec!r}: must be a mapping of {', '.join(SPLIT_KEYS)} (e.g. {{offload: cpu}}); "
            "split: auto (every device one group) goes at the devices config's top level"
        )
    unknown = set(spec) - set(SPLIT_KEYS)
    if unknown:
        raise ForgeError(f"{where}.split: unknown key(s) {sorted(unknown)}; a split block has {', '.join(SPLIT_KEYS)}")
    offload = spec.get("offload")
    if offload is not None and offload not in OFFLOADS:
        raise ForgeError(f"{where}.split.offload={offload!r}: must be cpu, disk or null (no offload)")
    link = spec.get("link_gb_per_s", DEFAULT_LINK_GB_PER_S)
    if not isinstance(link, (int, float)) or isinstance(link, bool) or not 0 < link < math.inf:
        raise ForgeError(f"{where}.split.link_gb_per_s={link!r}: must be a positive number of GB/s")
    return offload, float(link)


def per_member(value: Any, n: int, key: str, where: str) -> list[Any]:
    """One value per member: a list of n, or one value repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ForgeError(f"{where}.{key}: {len(value)} values for {n} devices; give one per device, or one for all")
        return list(value)
    return [value] * n


def budget_bytes(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ForgeError(f"{where}={value!r}: must be a positive number of GB; fix it in the devices config")
    return int(value * GB)


def group_from(entry: Mapping[str, Any], limits: Limits, overhead: int | None, where: str, step_time) -> Device:
    """The Device of a group entry (`step_time(spec, where)` reads a sim block)."""
    listed = entry["devices"]
    if not isinstance(listed, (list, tuple)) or not listed or not all(isinstance(d, str) and d for d in listed):
        raise ForgeError(f"{where}.devices={listed!r}: must be a list of torch devices, e.g. [cuda:0, cuda:1]")
    if len(set(listed)) != len(listed):
        raise ForgeError(f"{where}.devices={list(listed)}: a device is listed twice; list each once")
    if "disk" in listed:
        raise ForgeError(f"{where}.devices: disk is no member; allow it as split.offload: disk")
    if entry.get("device") is not None:
        raise ForgeError(f"{where}: give either device (one device) or devices (a group), not both")
    n = len(listed)
    memory = [budget_bytes(v, f"{where}.memory_gb") for v in per_member(entry.get("memory_gb"), n, "memory_gb", where)]
    sims = per_member(entry.get("sim"), n, "sim", where)
    steps = [step_time(s, f"{where}.sim") if s is not None else None for s in sims]
    if len({s is None for s in steps}) > 1:
        raise ForgeError(f"{where}.sim: give every member a sim block or none")
    offload, link = split_from(entry.get("split"), where)
    members = tuple(Member(d, m, s) for d, m, s in zip(listed, memory, steps))
    return group_device(entry["name"], members, limits, overhead, offload, link)


def group_device(
    name: str,
    members: tuple[Member, ...],
    limits: Limits,
    overhead: int | None,
    offload: str | None = None,
    link: float = DEFAULT_LINK_GB_PER_S,
) -> Device:
    """A group as declared: its members and limits; its step time and budget come with a placement."""
    first = members[0].sim
    return Device(
        name=name,
        limits=limits,
        torch_device=members[0].torch_device,
        memory_bytes=None,  # set from the placement: the tightest stage's room (forge.runtime.placement.device_map)
        batch_overhead_tokens=overhead,  # None: the placed group's step time gives it (a / b)
        sim=first,  # stands for "simulated" until the placement sets the group's own step time
        group=members,
        offload=offload,
        link_gb_per_s=link,
    )


def split_auto(devices: list[Device], split: Any) -> list[Device]:
    """`split: auto`: every device discovered or listed, as one group named `group`."""
    if split is None:
        return devices
    if split != "auto":
        raise ForgeError(f"devices.split={split!r}: must be auto (every device one group) or null")
    if any(d.group for d in devices):
        raise ForgeError("devices.split=auto: the inventory already lists a group; use one or the other")
    if len(devices) < 2:
        raise ForgeError(f"devices.split=auto: {len(devices)} device found; a group needs two or more")
    # a simulated device's member names what it stands for: its inventory name
    members = tuple(Member(d.name if d.sim else d.torch_device, d.memory_bytes, d.sim) for d in devices)
    lim = [d.limits for d in devices]
    limits = Limits(
        min(x.max_batch_tokens for x in lim),
        min(x.max_rows for x in lim),
        min(x.max_seq_len for x in lim),
        max(x.pad_multiple for x in lim),
    )
    return [group_device("group", members, limits, devices[0].batch_overhead_tokens)]
