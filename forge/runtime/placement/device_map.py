"""Placement: a device group's `device_map`, planned by Forge's memory model.

Model: the blocks of the model a worker loads (the full `AutoModelForCausalLM`: its embeddings,
each decoder layer, the final norm, the head) are sized by accelerate on a meta model built
from the config (`init_empty_weights`, `compute_module_sizes`; a class in the model's
`_no_split_modules` is never split). A function that reads hidden states up to layer L needs
only the layers before the cut (`cost_models.config_as_run`) and no head; the blocks it does
not need are mapped to "disk" (`Placement.unused`): they take no device or host memory, and
the worker cuts them off. The needed blocks are split in contiguous stages over the members
(`forge.runtime.placement.stages`), each stage keeping room for the activations of the batches the
packer will cut, from the function's measured `CostModel`; the group then reaches the packer
as one device whose limits and budget are its tightest stage's (`forge.runtime.placement.group_device`).

Beside it, what `accelerate.infer_auto_device_map` chooses for the full model with the same
budgets (and the CPU behind them, as `device_map="auto"` has): its bytes per device and what
it offloads.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import Any

from forge.errors import ForgeError
from forge.runtime.placement.stages import Split, best_split, deepest_that_fits, gib, offload_split
from forge.vocab.geometry import Device, Limits


@dataclass(frozen=True)
class Stage:
    """One member's share of the model."""

    device: str  # the member's torch device ("cuda:0"; a simulated group's: what it stands for)
    layers: tuple[int, int] | None  # decoder layers [first, last] it holds; None: none
    blocks: int  # modules of the device_map it holds (embeddings, layers, norm, head)
    weights_bytes: int
    activation_bytes: int  # room left for a batch's activations: budget - weights - the memory model's fixed bytes
    budget_bytes: int


@dataclass(frozen=True)
class AccelerateChoice:
    """What `infer_auto_device_map` chooses for the full model with the members' budgets."""

    bytes_per_device: dict[str, int]  # weights it puts on each device ("cpu", "disk": offloaded)
    layers_per_device: dict[str, int]  # decoder layers on each
    offloaded_bytes: int


@dataclass(frozen=True)
class Placement:
    """Where a device group holds the model a function runs."""

    device_map: dict[str, str]  # module name -> "cuda:0" | "cpu" | "disk", as from_pretrained(device_map=) takes it
    max_memory: dict[str, int]  # per member device (and the offload target), bytes its weights may take: from the plan
    stages: tuple[Stage, ...]  # per member, in order
    activation_bytes: int  # room for a batch's activations on the tightest stage (the group's budget beyond weights)
    offload: str | None  # where the offloaded blocks live: cpu | disk | None
    offloaded_bytes: int  # weights of the blocks no member holds (streamed to the first member each step)
    unused: tuple[str, ...]  # modules the function does not run (past the cut, an unread head), mapped to "disk"
    layers_run: int  # decoder layers the function runs (the cut), of `layers_total`
    layers_total: int
    model_bytes: int  # the full model's weights (every block, used or not)
    transfer_bytes_per_token: int  # hidden-state bytes handed between stages per token (hops x hidden x dtype)
    accelerate: AccelerateChoice
    summary: str  # one line

    def accelerate_max_memory(self) -> dict[int | str, int]:
        """`max_memory` keyed as accelerate wants it: a CUDA device's index, "cpu", "disk"."""
        return {_accel_key(k): v for k, v in self.max_memory.items()}

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("device_map")
        return out


def _accel_key(device: str) -> int | str:
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else device


_META: dict[tuple[str, str], Any] = {}  # (config hash, dtype) -> its meta model: built once per process


def meta_model(config: Any, dtype: str, trust_remote_code: bool) -> Any:
    """The full causal LM of `config` on the meta device (no memory): its structure and sizes."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from forge.runtime.cost.memory_fit import DTYPES, config_hash

    key = (config_hash(config), dtype)
    if key not in _META:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        model.tie_weights()  # as from_pretrained does: a tied head then shares (and is sized with) the embeddings
        _META.clear()  # one model at a time: a plan places one function's model
        _META[key] = model
    return _META[key]


def blocks(model: Any) -> list[str]:
    """The device_map's modules in forward order: a `_no_split_modules` class, a module with
    parameters of its own or none below, is one block; a container is opened."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())

    def walk(prefix: str, module: Any) -> list[str]:
        children = list(module.named_children())
        own = any(True for _ in module.named_parameters(recurse=False)) or any(
            True for _ in module.named_buffers(recurse=False)
        )
        if not children or own or type(module).__name__ in no_split:
            return [prefix]
        return [b for name, child in children for b in walk(f"{prefix}.{name}" if prefix else name, child)]

    return walk("", model)


def _layer_names(model: Any, n: int) -> list[str]:
    """The decoder layers' module names (the one ModuleList of n modules under the base model)."""
    import torch

    lists = [name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        raise ForgeError(f"placement: cannot find the model's {n} decoder layers (one list of {n} modules)")
    return [f"{lists[0]}.{i}" for i in range(n)]


def placement_for(fn: Any, device: Device) -> Placement:
    """The placement of `fn`'s model (a forge ModelFunction) over `device`'s group."""
    from accelerate.utils import compute_module_sizes

    from forge.runtime.cost.memory_fit import DTYPES
    from forge.runtime.model.hf_compat import num_layers, text_config

    if not device.group:
        raise ForgeError(f"placement: device {device.name} is not a group (no devices listed)")
    missing = [m.torch_device for m in device.group if not m.memory_bytes]
    if missing:
        raise ForgeError(
            f"device group {device.name}: {', '.join(missing)} has no memory budget; set the entry's memory_gb"
        )
    dtype, trust = fn.model.torch_dtype, bool(fn.model.trust_remote_code)
    model = meta_model(fn.config, dtype, trust)
    total = num_layers(text_config(fn.config))
    keep = _layers_run(fn, total)
    names = blocks(model)
    sizes = compute_module_sizes(model)  # the meta model is built in the run's dtype
    layer_names = _layer_names(model, total)
    head = _head_name(model)
    needs_head = bool(fn.forward.lm_head or getattr(fn.forward, "head", False))
    unused = set(layer_names[keep:]) | (set() if needs_head or head is None else {head})
    tied = _tied_embeddings(model, names)
    needed = [b for b in names if b not in unused]
    cost = fn.cost_model()
    # the memory model's weights are those of the cut model it measured (its head included)
    measured = sum(sizes[b] for b in names if b not in layer_names[keep:])
    fixed = max(0, cost.weight_bytes - measured)
    hidden = int(text_config(fn.config).hidden_size) * DTYPES[dtype].itemsize
    step = int(fn.step_bytes(device))
    held = [sizes[b] for b in needed]
    ctx = _Context(device, cost, fixed, held, needed, layer_names, keep, total, sizes[""], hidden, step)
    split = _choose(ctx, sizes, head)
    device_map = _device_map(ctx, split, names, unused, tied, head)
    return _placement(ctx, split, device_map, tuple(b for b in names if b in unused), _accelerate_choice(ctx, model))


@dataclass
class _Context:
    device: Device
    cost: Any  # forge.batching.cost.CostModel
    fixed: int
    sizes: list[int]  # needed blocks' bytes, in order
    needed: list[str]
    layer_names: list[str]
    keep: int
    total: int
    model_bytes: int
    hidden_bytes: int  # one token's hidden state, in the run's dtype
    step_bytes: int  # what a step holds beyond the cost model (Function.step_bytes): every stage keeps it

    @property
    def budgets(self) -> list[int]:
        return [int(m.memory_bytes or 0) for m in self.device.group]


def _layers_run(fn: Any, total: int) -> int:
    if fn.forward.lm_head:
        return total
    from forge.runtime.cost.models import config_as_run, layers_read
    from forge.runtime.model.hf_compat import num_layers

    return min(total, num_layers(config_as_run(fn.config, layers_read(fn), bool(fn.model.trust_remote_code))))


def _head_name(model: Any) -> str | None:
    out = model.get_output_embeddings()
    return next((name for name, m in model.named_modules() if m is out), None) if out is not None else None


def activation_bound(cost: Any, limits: Limits, tokens: int) -> int:
    """Activation bytes of any batch of at most `tokens` slots in rows of at most max_seq_len (a
    full-length row's KV included), and the prefix's own entry: what a stage keeps room for."""
    L = limits.max_seq_len
    per_token = cost.bytes_per_token + L * cost.bytes_per_score + cost.kv_bytes_per_token
    return int(tokens * per_token + L * cost.prefix_bytes_per_token) + 1


def _reserve(ctx: _Context) -> int:
    """The least room a stage keeps: one full-length row's activations, and what a step holds beyond them."""
    lim = ctx.device.limits
    return activation_bound(ctx.cost, lim, lim.pad(lim.max_seq_len)) + ctx.step_bytes


def _choose(ctx: _Context, sizes: dict[str, int], head: str | None) -> Split:
    """The split with most room, or the offloaded one where allowed; else a one-line refusal."""
    reserve_min = _reserve(ctx)
    split = best_split(ctx.sizes, ctx.budgets, ctx.fixed)
    if split is not None and split.tightest_room >= reserve_min:
        return split
    if ctx.device.offload is not None:
        off = offload_split(ctx.sizes, ctx.budgets, ctx.fixed, reserve_min)
        if off is not None:
            return off
    raise ForgeError(_refusal(ctx, sizes, reserve_min, head))


def _refusal(ctx: _Context, sizes: dict[str, int], reserve_min: int, head: str | None) -> str:
    first = ctx.needed.index(ctx.layer_names[0])
    before = sum(ctx.sizes[:first])  # the embeddings
    after = sum(s for b, s in zip(ctx.needed[first:], ctx.sizes[first:]) if b not in ctx.layer_names and b != head)
    layers = [sizes[b] for b in ctx.layer_names]
    fits = deepest_that_fits(layers, before, after, ctx.budgets, ctx.fixed, reserve_min)
    what = "the whole model" if ctx.keep == ctx.total else f"{ctx.keep} of its {ctx.total} layers"
    what += " and the LM head" if head in ctx.needed else ""
    cut = f"a function reading layer <= {fits - 1} would fit" if fits > 0 else "no cut fits"
    if ctx.device.offload is not None:  # offload is allowed already: what is short is room for the row
        return (
            f"device group {ctx.device.name}: even with split.offload: {ctx.device.offload}, its first member has no "
            f"room for one {ctx.device.limits.max_seq_len}-token row ({gib(reserve_min + ctx.fixed)} of activations "
            f"and KV) beside streaming in the largest offloaded block (budgets {', '.join(map(gib, ctx.budgets))}); "
            "lower devices.limits.max_seq_len or add memory"
        )
    return (
        f"device group {ctx.device.name}: the function needs {what} ({gib(sum(ctx.sizes))} of weights), more than "
        f"its members' {gib(sum(ctx.budgets))} hold while keeping {gib(reserve_min + ctx.fixed)} per card for one "
        f"{ctx.device.limits.max_seq_len}-token row; {cut}; or allow split.offload: cpu (slow) or add memory"
    )


def _tied_embeddings(model: Any, names: list[str]) -> str | None:
    """The block holding the input embeddings when the head's weight is theirs (tied), else None."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or getattr(inp, "weight", None) is not getattr(out, "weight", 1):
        return None
    return next((name for name, m in model.named_modules() if m is inp and name in names), None)


def _device_map(
    ctx: _Context, split: Split, names: list[str], unused: set[str], tied: str | None, head: str | None
) -> dict[str, str]:
    members = [m.torch_device for m in ctx.device.group]
    where: dict[str, str] = {}
    k = 0
    for i, n in enumerate(split.counts):
        for b in ctx.needed[k : k + n]:
            where[b] = members[i]
        k += n
    for b in ctx.needed[k:]:
        where[b] = ctx.device.offload or "disk"
    last = members[0]
    out = {}
    for b in names:  # every module named, in order
        out[b] = "disk" if b in unused else where.get(b, last)
        last = out[b] if b not in unused else last
    if head is not None and tied is not None and head not in unused:
        out[head] = out[tied]  # a tied head's weight is the embeddings': it runs where they are
    return out


def _placement(ctx: _Context, split: Split, device_map: dict[str, str], unused: tuple[str, ...], accel) -> Placement:
    members = [m.torch_device for m in ctx.device.group]
    stages, k = [], 0
    for i, n in enumerate(split.counts):
        held = [ctx.layer_names.index(b) for b in ctx.needed[k : k + n] if b in ctx.layer_names]
        k += n
        stages.append(
            Stage(
                device=members[i],
                layers=(held[0], held[-1]) if held else None,
                blocks=n,
                weights_bytes=split.weights[i],
                activation_bytes=split.room[i],
                budget_bytes=ctx.budgets[i],
            )
        )
    room = split.tightest_room
    max_memory = {m: b - room for m, b in zip(members, ctx.budgets)}
    if split.offloaded and ctx.device.offload:
        max_memory[ctx.device.offload] = split.offloaded_bytes
    placement = Placement(
        device_map=device_map,
        max_memory=max_memory,
        stages=tuple(stages),
        activation_bytes=room,
        offload=ctx.device.offload if split.offloaded else None,
        offloaded_bytes=split.offloaded_bytes,
        unused=unused,
        layers_run=ctx.keep,
        layers_total=ctx.total,
        model_bytes=ctx.model_bytes,
        transfer_bytes_per_token=ctx.hidden_bytes * max(0, sum(1 for n in split.counts if n) - 1),
        accelerate=accel,
        summary="",
    )
    return _with_summary(ctx.device.name, placement)


def _with_summary(name: str, p: Placement) -> Placement:
    from dataclasses import replace

    def card(s: Stage) -> str:
        span = f"layers {s.layers[0]}-{s.layers[1]}" if s.layers else "no layers"
        return f"{s.device} {span} {gib(s.weights_bytes)} + {gib(s.activation_bytes)} room of {gib(s.budget_bytes)}"

    off = f"{gib(p.offloaded_bytes)} offloaded to {p.offload}" if p.offload else "nothing offloaded"
    a = p.accelerate
    theirs = ", ".join(f"{d} {gib(b)}" for d, b in a.bytes_per_device.items())
    line = (
        f"{name}: {p.layers_run} of {p.layers_total} layers: " + "; ".join(card(s) for s in p.stages) + f"; {off}"
        f" | accelerate (full model): {theirs}"
    )
    return replace(p, summary=line)


def _accelerate_choice(ctx: _Context, model: Any) -> AccelerateChoice:
    """`infer_auto_device_map` on the full model with the members' budgets and the CPU behind them."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    members = [m.torch_device for m in ctx.device.group]
    budgets: dict[int | str, int] = {i: b for i, b in enumerate(ctx.budgets)}
    budgets["cpu"] = 1 << 50  # device_map="auto" offloads to host memory what the cards do not hold
    log = logging.getLogger("accelerate.utils.modeling")
    level = log.level
    log.setLevel(logging.ERROR)  # "Device 0 is not available": planning on a machine without the cards
    try:
        with contextlib.redirect_stdout(None):
            chosen = infer_auto_device_map(
                model,
                max_memory=budgets,
                no_split_module_classes=list(getattr(model, "_no_split_modules", None) or ()),
            )
    finally:
        log.setLevel(level)
    sizes = compute_module_sizes(model)
    per: dict[str, int] = {}
    layers: dict[str, int] = {}
    for key, where in chosen.items():
        name = members[where] if isinstance(where, int) else str(where)
        per[name] = per.get(name, 0) + sizes[key]
        n = sum(1 for x in ctx.layer_names if x == key or x.startswith(key + "."))
        layers[name] = layers.get(name, 0) + n
    off = sum(b for d, b in per.items() if d in ("cpu", "disk"))
    return AccelerateChoice(bytes_per_device=per, layers_per_device=layers, offloaded_bytes=off)
