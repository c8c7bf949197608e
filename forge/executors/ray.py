"""One Ray actor per device: the same run, on a Ray cluster (or a local Ray instance).

Scheduling stays in the driver (packer, prefix-affinity routing, the ledger, commits); actors
only run batches. Each actor loads the function's worker once (`function.open_worker`),
receives batches (token ids included) and returns the function's output through the object
store. Same model as the process executor: per device a FIFO of at most `max_in_flight`
batches (the head runs; an actor runs its calls in order), outcomes collected in completion
order with `ray.wait`; a dead actor's batches come back LOST and a replacement is started, up
to `max_restarts` per device, then the device is retired; a head past its deadline comes
back TIMEOUT and the actor is killed unless it answers within `kill_grace_s` (that
bookkeeping is `forge.executors.base.SlotExecutor`'s, shared with the process executor).

Ray is an optional extra (`pip install -e '.[ray]'`); it is imported only when this
executor is built.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from forge.errors import ForgeError
from forge.executors.base import Outcome, Slot, SlotExecutor, Status, one_line
from forge.executors.worker import Ran, run_batch, sticky_error
from forge.vocab.geometry import Batch, Device
from forge.vocab.procs import resident_bytes, resident_peak_bytes

if TYPE_CHECKING:
    from forge.config.schema import RayRuntime

ENV_PREFIXES = ("FORGE_", "HF_")  # driver variables actors get (cache, offline mode, test faults)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ForgeError("runtime=ray needs Ray, an optional extra: pip install -e '.[ray]'") from None
    return ray


@dataclass(kw_only=True)
class _Slot(Slot):
    actor: Any
    load_ref: Any  # the actor's load() call: its description once the model is loaded


class RayExecutor(SlotExecutor[_Slot]):
    """The executor `runtime=ray` builds (a forge_executors factory), from a RayRuntime."""

    worker = "actor"

    def __init__(self, function, cache_tokens: int, runtime: RayRuntime, *, plugins: tuple[str, ...] = (), hook=None):
        super().__init__(
            max_in_flight=runtime.max_in_flight,
            max_restarts=runtime.max_restarts,
            startup_timeout_s=runtime.startup_timeout_s,
            kill_grace_s=runtime.kill_grace_s,
        )
        self.ray = import_ray()
        self.function = function
        self.cache_tokens = cache_tokens
        self.plugins = tuple(plugins)  # registered in each actor: its fault points fire there, not via `hook`
        self.address = runtime.address
        self.num_cpus = runtime.num_cpus
        self.cpus_per_actor = float(runtime.cpus_per_actor)
        self.keep_freed_memory = runtime.keep_freed_memory  # a CPU actor's allocator (forge.executors.cpu_process)
        self.actors: dict[str, dict] = {}  # device -> what its (latest) actor reported when it loaded
        self._owns_ray = False  # this executor called ray.init: shutdown at close (stops a local instance)
        self._actor_cls: Any = None  # DeviceActor as a Ray actor class, made at start
        self._function_ref: Any = None  # the function, put in the object store once for every actor

    # -- lifecycle --------------------------------------------------------------
    def start(self, devices: list[Device]) -> None:
        ray = self.ray
        if not ray.is_initialized():
            if self.address:  # join a cluster: its nodes have Forge installed
                ray.init(address=self.address)
            else:  # a local instance: workers import what this process imports (its sys.path beyond the venv)
                path = os.pathsep.join(
                    p for p in sys.path if p and os.path.isdir(p) and not p.startswith((sys.prefix, sys.base_prefix))
                )
                ray.init(
                    num_cpus=self.num_cpus,
                    include_dashboard=False,
                    runtime_env={"env_vars": {"PYTHONPATH": path}} if path else None,
                )
            self._owns_ray = True
        self._actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(DeviceActor)
        self._function_ref = ray.put(self.function)
        for device in devices:
            self.restarts[device.name] = 0
            self._spawn(device)

    def _spawn(self, device: Device) -> None:
        resources = {"num_gpus": _gpus(device), "num_cpus": self.cpus_per_actor}
        env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
        actor = self._actor_cls.options(**resources).remote(
            [self._function_ref],
            device,
            self.cache_tokens,
            self.plugins,
            max(1, int(self.cpus_per_actor)),
            self.keep_freed_memory,
            env,
        )
        self.slots[device.name] = _Slot(
            device=device, actor=actor, load_ref=actor.load.remote(), started=time.monotonic()
        )

    def _kill(self, slot: _Slot) -> None:
        try:
            self.ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def close(self, grace_s: float = 5.0) -> None:
        for slot in self.slots.values():
            self._kill(slot)
        self.slots.clear()
        self._function_ref = None
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self._owns_ray = False

    def info(self) -> dict[str, Any]:
        return {"ray": {"address": self.address or "local", "actors": dict(self.actors)}}

    # -- work -------------------------------------------------------------------
    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None:
        slot = self.slots[device.name]
        self._queue(slot, ticket, timeout_s, slot.actor.run.remote(batch))

    def collect(self, wait_s: float) -> list[Outcome]:
        now = time.monotonic()
        deadline = now + (0.0 if self._pending else wait_s)
        refs = []
        for slot in self.slots.values():
            due = self._due(slot)
            if due is not None:
                deadline = min(deadline, due)
            if not slot.ready:
                refs.append(slot.load_ref)
            refs.extend(ref for _, _, ref in slot.queue)
        if not refs:  # nothing to wait on: do not spin
            time.sleep(max(0.0, deadline - now))
        else:
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - now))
            if ready:  # sweep whatever else finished too
                ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(ready)
            for slot in list(self.slots.values()):
                self._read(slot, done)
        now = time.monotonic()
        for slot in list(self.slots.values()):
            self._check_time(slot, now)
        out, self._pending = self._pending, []
        return out

    def _read(self, slot: _Slot, done: set) -> None:
        ray, name = self.ray, slot.device.name
        if not slot.ready:
            if slot.load_ref not in done:
                return
            try:
                self.actors[name] = {**ray.get(slot.load_ref), "ready_s": round(time.monotonic() - slot.started, 2)}
            except ray.exceptions.RayActorError as exc:
                return self._replace(slot, f"actor of {name} died while loading ({_cause(exc)})")
            except Exception as exc:  # noqa: BLE001 - the load's own error, raised in the actor
                return self._replace(slot, f"actor of {name} could not load the model: {_cause(exc)}")
            self._ready(slot, self.actors[name].get("load_s"))
            self.resident_ready_bytes.setdefault(name, self.actors[name].get("resident_bytes") or 0)
        while slot.queue and slot.queue[0][2] in done:  # an actor answers in order
            ticket, _, ref = slot.queue[0]
            try:
                kind, payload, seconds, peak = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died (killed, crashed, node lost)
                return self._replace(slot, f"actor of {name} died ({_cause(exc)})")
            slot.queue.popleft()
            self._answered(slot)
            ran = Ran(Status(kind), payload, seconds)
            self._resident(name, peak)
            self._pending.append(ran.outcome(ticket, name))
            # the actor's reason is all that crossed: the marker of a sticky error must be in its first line
            if ran.status != Status.COMPLETED and sticky_error(payload):
                return self._replace(slot, f"actor of {name}: sticky device error: {payload}")


def _cause(exc: BaseException) -> str:
    """One line for a Ray error: the original error of a task, else Ray's own first line."""
    cause = getattr(exc, "cause", None)
    return one_line(cause) if isinstance(cause, BaseException) else one_line(exc)


# ----------------------------------------------------------------------------- the actor


class DeviceActor:
    """Runs batches on one device; the model is loaded once by `load`."""

    def __init__(
        self,
        function_ref: list,
        device: Device,
        cache_tokens: int,
        plugins: tuple[str, ...],
        threads: int,  # torch threads of a CPU actor
        keep_freed_memory: bool,  # runtime.keep_freed_memory
        env: dict[str, str],
    ):
        import ray

        os.environ.update(env)  # before the function's modules are imported (HF_HUB_OFFLINE is read then)
        function = ray.get(function_ref[0])  # a ref in a list is not resolved before __init__ runs
        device = _as_seen_by_actor(device)
        self.function, self.device, self.cache_tokens = function, device, cache_tokens
        self.plugins, self.threads, self.keep_freed_memory = plugins, threads, keep_freed_memory
        self.worker: Any = None  # the function's worker, and the hook relay of `plugins`: made by load()
        self.hook: Any = None

    def load(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        from forge.pluginmanager import make_plugin_manager

        if self.device.torch_device == "cpu":
            from forge.executors.cpu_process import run_cpu_device

            run_cpu_device(self.threads, self.keep_freed_memory)
        self.hook = make_plugin_manager(load_entry_points=False, modules=self.plugins).hook
        self.worker = self.function.open_worker(self.device, self.cache_tokens)
        return {**self.describe(), "load_s": round(time.perf_counter() - t0, 2), "resident_bytes": resident_bytes()}

    def describe(self) -> dict[str, Any]:
        """Where this actor runs and what it may use."""
        import ray

        info: dict[str, Any] = {
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "torch_device": self.device.torch_device,
            "limits": self.device.limits.as_dict(),
            "memory_budget_bytes": self.device.memory_bytes,
        }
        if self.device.torch_device.startswith("cuda"):
            import torch

            info["gpu_ids"] = ray.get_gpu_ids()
            info["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        else:
            info["threads"] = self.threads
        return info

    def run(self, batch: Batch) -> tuple[str, Any, float, int]:
        """(status, payload, seconds, the actor process's resident peak bytes so far)."""
        ran = run_batch(self.worker, self.hook, self.device, batch)
        return ran.status.value, ran.payload, ran.seconds, resident_peak_bytes()


def _gpus(device: Device) -> int:
    """The GPUs an actor asks Ray for: one per CUDA member of a device group, else one for a CUDA device."""
    if device.group:
        return sum(m.torch_device.startswith("cuda") for m in device.group)
    return 1 if device.torch_device.startswith("cuda") else 0


def _as_seen_by_actor(device: Device) -> Device:
    """The device renamed as the actor sees it: Ray shows it only its own GPUs, as cuda:0, cuda:1, ...
    (a device group's CUDA members in stage order)."""
    if device.group:
        cuda = iter(range(len(device.group)))
        members = tuple(
            replace(m, torch_device=f"cuda:{next(cuda)}") if m.torch_device.startswith("cuda") else m
            for m in device.group
        )
        first = members[0].torch_device
        return replace(device, group=members, torch_device=first)
    if device.torch_device.startswith("cuda"):
        return replace(device, torch_device="cuda:0")
    return device
