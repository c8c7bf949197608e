"""Whether the devices a run names exist on this machine, checked before the run directory is
made or any model loads: `tpu:0`, or `cuda:7` on a machine with two GPUs (or a CPU-only torch),
is one line naming the device and what this machine has."""

from __future__ import annotations

from collections.abc import Iterable

from forge.errors import ForgeError
from forge.vocab.geometry import Device


def _where(device: Device) -> list[tuple[str, str]]:
    """(the device's name, a torch device it puts layers on) for a device and a group's members."""
    if device.group:
        return [(device.name, m.torch_device) for m in device.group if m.torch_device != "disk"]
    return [(device.name, device.torch_device)]


def _available() -> str:
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return ", ".join(found)


def _problem(torch_device: str) -> str | None:
    import torch

    try:
        where = torch.device(torch_device)
    except (RuntimeError, ValueError) as exc:
        return f"is not a torch device name ({type(exc).__name__}: cpu, cuda:N, mps, ...)"
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if where.index is None else where.index
        if index >= count:
            return f"is not on this machine (it has {count} CUDA device{'s' if count != 1 else ''})"
    elif where.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        return "is not on this machine (no MPS)"
    elif where.type not in ("cpu", "cuda", "mps", "meta"):
        module = getattr(torch, where.type, None)
        if module is None or not getattr(module, "is_available", lambda: False)():
            return f"is not on this machine ({where.type} is not available to torch)"
    return None


def check_present(devices: Iterable[Device]) -> None:
    """Refuse, before any work, a device (or a group's member) this machine does not have."""
    for device in devices:
        if device.sim is not None:
            continue
        for name, torch_device in _where(device):
            problem = _problem(torch_device)
            if problem is not None:
                shown = name if name == torch_device else f"{name} ({torch_device})"
                raise ForgeError(
                    f"devices: {shown} {problem}; this machine has {_available()}: "
                    "choose devices=auto or an inventory of those"
                )
