"""One model over several devices: a device map's placement, done by accelerate's dispatch.

Model: a device group's worker (`forge.vocab.geometry.Device.group`) loads its model on the CPU;
the causal runner cuts the decoder one layer past the deepest state it reads
(`forge.runtime.hf_compat.keep_first_layers`), and only then `Dispatch.place` hands what is left
to `accelerate.dispatch_model` with the plan's device map (`forge.runtime.placement`: module
name -> "cuda:0" | "cpu" | "disk"), so the layers cut are never placed. Each mapped block
(embeddings, each decoder layer, final norm, LM head) keeps its weights on its device:

* a device ("cuda:1"): the block runs there; accelerate's hooks move its inputs (hidden states,
  masks, position embeddings) to it, so its outputs and its KV stay there;
* "cpu" beside an accelerator: weights stay in CPU memory and are copied to the main device
  (the first accelerator of the map) for each forward pass: the cost is the block's weight
  bytes over the host link, every step;
* "disk": weights are written once to an offload folder this worker owns (`Dispatch.folder`,
  removed by `close`) and read back for each forward pass, onto the main device (the CPU when
  the map names no accelerator): the cost is the block's weight bytes read from disk, every step.

The runner puts its inputs on `input_device(model)` (the embeddings' execution device) and reads
each output where it is: a hidden state at layer L is on layer L's device, and so is the prefix
cache's KV of layer L (nothing is gathered to one device before it is pooled or sliced).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

import torch

from forge.runtime.hf_compat import input_device as input_device  # where a placed model's token ids go

OFFLOAD_PREFIX = "forge-offload-"  # the worker's offload folder (disk offload), in the system's temp folder


def kept_map(model: torch.nn.Module, device_map: dict[str, str], main: str | None = None) -> dict[str, str]:
    """The map's entries for the modules `model` still has (the runner's cut drops later layers),
    plus, on the main device, modules holding buffers alone that the map does not name (rotary
    embeddings' frequencies); ValueError naming the first weight the map leaves unplaced."""
    names = {n for n, _ in model.named_modules()}
    kept = {name: str(dev) for name, dev in device_map.items() if name in names or name == ""}
    covered = lambda name: any(k == "" or name == k or name.startswith(k + ".") for k in kept)  # noqa: E731
    for name, _ in model.named_parameters():
        if not covered(name):
            raise ValueError(f"device_map places no module holding {name}; plan the group again (forge plan)")
    for name, _ in model.named_buffers():
        if not covered(name):
            kept[name.rpartition(".")[0]] = main or main_device(kept)
    return kept


def main_device(device_map: dict[str, str]) -> str:
    """The device offloaded blocks compute on: the map's first accelerator, else the CPU."""
    return next((d for d in device_map.values() if d not in ("cpu", "disk")), "cpu")


class Dispatch:
    """Places one worker's model by `device_map` (once, after the runner's cut) and owns its
    offload folder: `close` removes it (so does the model's collection, or the interpreter's exit)."""

    def __init__(
        self, device_map: dict[str, str], offload: str | None = None, main: str | None = None, unused: Any = ()
    ):
        if not device_map:
            raise ValueError("a device group's placement has an empty device_map; plan the group again (forge plan)")
        # modules the function never runs: the runner cuts the layers; an unread head left stays in host memory
        device_map = {name: "cpu" if name in set(unused) else str(dev) for name, dev in device_map.items()}
        disk = [name for name, dev in device_map.items() if dev == "disk"]
        if disk and offload != "disk":
            raise ValueError(
                f"device_map offloads {disk[0]} to disk but the group allows offload={offload}; "
                "set split.offload: disk or plan the group again"
            )
        self.device_map = dict(device_map)
        self.main = main  # where "cpu" and "disk" blocks compute (None: the map's first accelerator; "cpu": on the CPU)
        self.folder: str | None = None
        self._cleanup: Any = None

    def place(self, model: Any) -> Any:
        """`model` (on the CPU, cut) dispatched by the map; returns it."""
        from accelerate import dispatch_model

        placed = kept_map(model, self.device_map, self.main)
        if "disk" in placed.values():
            self.folder = tempfile.mkdtemp(prefix=OFFLOAD_PREFIX)
            self._cleanup = weakref.finalize(model, shutil.rmtree, self.folder, True)  # lives while the model does
        main = self.main or main_device(placed)
        skip = getattr(
            model, "_skip_keys_device_placement", None
        )  # the KV cache object: never moved, its layers stay put
        dispatch_model(model, placed, main_device=main, offload_dir=self.folder, skip_keys=skip, force_hooks=True)
        return model

    @property
    def devices(self) -> list[str]:
        """The devices the placed blocks are on ("disk" and "cpu" included), in map order."""
        return list(dict.fromkeys(self.device_map.values()))

    def close(self) -> None:
        """Remove the offload folder (the model's disk-offloaded weights)."""
        if self._cleanup is not None:
            self._cleanup()
        self._cleanup = None


def dispatch_for(fn: Any, device: Any) -> Dispatch | None:
    """A device group's dispatch, by the plan's placement for `fn` on it; None: a single device."""
    if not getattr(device, "group", ()):
        return None
    from forge.runtime.placement import placement_for

    placement = placement_for(fn, device)
    return Dispatch(placement.device_map, getattr(device, "offload", None), unused=placement.unused)
