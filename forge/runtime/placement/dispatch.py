"""One model over several devices: a device group's placement, done by accelerate.

Model: a device group's worker (`forge.vocab.geometry.Device.group`) gets the plan's placement
(`forge.runtime.placement.device_map.placement_for`: a device map, module name -> "cuda:0" | "cpu" | "disk",
the layers the function runs and the modules it never runs). `Dispatch.load` reads the model
with `from_pretrained(device_map=...)`: each block's weights go straight from the checkpoint to
its device (no whole copy in host memory first), and only the decoder layers the function runs
are read at all (the config is cut to that depth for the load, then given back its whole depth,
so hidden-state indices keep their meaning; the runner sees the cut done). `Dispatch.place`
does the same for a model already in host memory (`accelerate.dispatch_model`; the causal
runner calls it after its own cut, so cut layers are never placed either); `load` goes that way
too, reading the cut model into host memory first, where the main device matters
(`places_itself`: `from_pretrained` would leave it to chance). Each block:

* on a device ("cuda:1"): runs there; accelerate's hooks move its inputs (hidden states, masks,
  position embeddings) to it, so its outputs and its KV stay there;
* on "cpu" beside an accelerator: stays in host memory and is copied to the main device for each
  forward pass (accelerate's CPU offload): its weight bytes over the host link, every step;
* on "disk": read from the checkpoint's safetensors (or an offload folder this worker owns,
  removed by `close`) for each forward pass onto the main device (the CPU when the map names no
  accelerator): its weight bytes from disk, every step.

A module the function never runs (an unread LM head) is mapped to "cpu": never run, never copied.
The runner puts token ids on `input_device(model)` (the embeddings' execution device) and reads
every output where it is: a hidden state after layer L is on layer L's device, and so is the
prefix cache's KV of layer L (nothing is gathered onto one device before it is pooled or sliced).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

from forge.runtime.model.hf_compat import input_device as input_device  # where a placed model's token ids go
from forge.vocab.procs import pid_alive

OFFLOAD_PREFIX = "forge-offload-"  # the worker's offload folder (disk offload), in the system's temp folder


def remove_stale_offload(temp_dir: str | None = None) -> list[str]:
    """Remove the offload folders that workers killed without clean-up (kill -9) left: this user's
    `forge-offload-<pid>-*` folders whose process is gone. The folders removed."""
    removed = []
    for entry in os.scandir(temp_dir or tempfile.gettempdir()):
        pid = entry.name[len(OFFLOAD_PREFIX) :].partition("-")[0]
        if not (entry.name.startswith(OFFLOAD_PREFIX) and pid.isdigit() and entry.is_dir(follow_symlinks=False)):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.geteuid() or pid_alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


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


def places_itself(device_map: dict[str, str], main: str | None) -> bool:
    """Whether `Dispatch.load` must place the model itself rather than let `from_pretrained` do it:
    a main device is asked for, or offloaded blocks sit beside several accelerators (accelerate
    would take their device from an unordered set; the plan streams them to the first member)."""
    accelerators = {d for d in device_map.values() if d not in ("cpu", "disk")}
    offloaded = any(d in ("cpu", "disk") for d in device_map.values())
    return main is not None or (offloaded and len(accelerators) > 1)


def main_device(device_map: dict[str, str]) -> str:
    """The device offloaded blocks compute on: the map's first accelerator, else the CPU."""
    return next((d for d in device_map.values() if d not in ("cpu", "disk")), "cpu")


class Dispatch:
    """Loads (or places) one worker's model by `device_map` and owns its offload folder: `close`
    removes it (so does the collection of this object, which the model keeps alive, or the exit)."""

    def __init__(
        self,
        device_map: dict[str, str],
        offload: str | None = None,
        main: str | None = None,
        unused: Any = (),
        layers: int | None = None,
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
        self.layers = layers  # decoder layers `load` reads (the plan's cut; None: every one)
        self.main = main  # where "cpu" and "disk" blocks compute (None: the map's first accelerator; "cpu": the CPU)
        self.folder: str | None = None
        self._cleanup: Any = None

    def load(self, hf: Any, loader: Any, attn: str | None) -> Any:
        """The model `hf` (a `forge.runtime.model.spec.HFModel`) names, read by `loader` straight onto
        its devices (`from_pretrained(device_map=...)`: no whole copy in host memory first), with only
        its first `self.layers` decoder layers read: the others are never read, nor placed. Its
        config keeps the whole depth, so hidden-state indices mean what they mean for the whole
        model; `hf_compat.LOADED_LAYERS` on it says how many layers it holds."""
        from accelerate import init_empty_weights
        from transformers.utils import logging as hf_logging

        from forge.runtime.cost.memory_fit import at_depth
        from forge.runtime.model.hf_compat import LOADED_LAYERS, num_layers

        full = hf.config
        total = num_layers(full)
        keep = total if self.layers is None else min(self.layers, total)
        config = at_depth(full, keep) if keep < total else full
        with init_empty_weights():
            shape = loader.from_config(config, trust_remote_code=bool(hf.spec.trust_remote_code))
        placed = kept_map(shape, self.device_map, self.main)
        own = places_itself(placed, self.main)
        before = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the checkpoint's layers past the cut are unexpected keys, skipped
        try:
            if own:  # read (cut) into host memory, then placed with the main device said
                model = self.place(hf.load(loader, "cpu", attn, config=config))
            else:
                folder = self._folder(placed)
                model = hf.load(loader, None, attn, config=config, device_map=placed, offload_folder=folder)
        finally:
            hf_logging.set_verbosity(before)
        model.forge_dispatch = self  # the model keeps its offload folder's owner alive
        if keep < total:
            model.config.num_hidden_layers = total
            if getattr(full, "layer_types", None):
                model.config.layer_types = list(full.layer_types)
            setattr(model, LOADED_LAYERS, keep)
        return model

    def _folder(self, placed: dict[str, str]) -> str | None:
        """A new offload folder where the map offloads to disk (None: it does not)."""
        if "disk" not in placed.values():
            return None
        remove_stale_offload()
        folder = self.folder = tempfile.mkdtemp(prefix=f"{OFFLOAD_PREFIX}{os.getpid()}-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)  # if close never runs
        return folder

    def place(self, model: Any) -> Any:
        """`model` (in host memory, already cut) dispatched by the map; returns it."""
        from accelerate import dispatch_model

        placed = kept_map(model, self.device_map, self.main)
        folder = self._folder(placed)
        main = self.main or main_device(placed)
        skip = getattr(model, "_skip_keys_device_placement", None)  # the KV cache object: never moved
        dispatch_model(model, placed, main_device=main, offload_dir=folder, skip_keys=skip, force_hooks=True)
        model.forge_dispatch = self  # the model keeps its offload folder's owner alive
        return model

    def close(self) -> None:
        """Remove the offload folder (the model's disk-offloaded weights)."""
        if self._cleanup is not None:
            self._cleanup()
        self._cleanup = None


def dispatch_for(fn: Any, device: Any) -> Dispatch | None:
    """A device group's dispatch, by the plan's placement for `fn` on it; None: a single device."""
    if not getattr(device, "group", ()):
        return None
    from forge.runtime.placement.device_map import placement_for

    placement = placement_for(fn, device)
    offload = getattr(device, "offload", None)
    return Dispatch(placement.device_map, offload, unused=placement.unused, layers=placement.layers_run)
