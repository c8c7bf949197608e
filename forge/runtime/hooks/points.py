"""Hook points of a causal LM's decoder: values captured there and interventions applied there,
the same for every token whatever layout it runs in.

Names (`point_layer`): Forge's family-independent names, each at decoder layer L,

    resid_pre.L    the residual stream into layer L (hidden_states[L])
    resid_post.L   the residual stream out of layer L (before the final norm, for the last layer)
    attn_out.L     the attention block's output (after its output projection, before the residual add)
    mlp_in.L       the MLP block's input (after its norm)
    mlp_out.L      the MLP block's output (before the residual add)
    attn_pattern.L the attention probabilities [heads, queries, keys] (eager attention only)

or a module path of the loaded model (``model.layers.3.mlp.down_proj``): its output, which must
hold one value per token ([rows, tokens, ...]). Each is a PyTorch forward hook (pre-hook for
inputs) on the module; `HookSet` installs them once per worker and each forward pass tells it
where every row slot sits in its item's sequence (`Slots`), so an intervention's token span
(prefix, text, last, positions) means the same tokens in rows of whole prompts, after a split
or cached prefix, in packed rows and in tree rows. A capture keeps the value after any
intervention at that point (what flows on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from forge.runtime.hooks.interventions import Intervention
from forge.runtime.model import hf_compat

POINTS = ("resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_out", "attn_pattern")
ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")  # the attention block, by family
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")  # the MLP (or mixture-of-experts) block
# layers without an MLP block (OPT): its input is the first projection's input, its output the second's output
MLP_IN_LINEAR, MLP_OUT_LINEAR = ("fc1",), ("fc2",)


@dataclass(frozen=True)
class HookPoint:
    """A place in the model, as a function names it."""

    name: str  # as asked: "mlp_out.2" or a module path
    kind: str  # one of POINTS, or "module"
    layer: int | None  # the decoder layer it belongs to (None: a module path, found when the model loads)


def parse_point(name: str, num_layers: int) -> HookPoint:
    """A hook point's name checked against the model's depth (ValueError with the fix otherwise)."""
    kind, dot, index = str(name).rpartition(".")
    if kind in POINTS:
        if not index.lstrip("-").isdigit():
            raise ValueError(f"hook point {name!r}: the layer after {kind}. must be an integer")
        layer = int(index)
        if not -num_layers <= layer < num_layers:
            raise ValueError(f"hook point {name!r}: the model has layers 0..{num_layers - 1}")
        return HookPoint(name, kind, layer % num_layers)
    if not name or name.startswith(".") or name.endswith("."):
        raise ValueError(
            f"hook point {name!r}: use one of {', '.join(p + '.L' for p in POINTS)} or a module path "
            "such as model.layers.3.mlp.down_proj"
        )
    return HookPoint(name, "module", None)


def decoder_layers(base: Any, num_layers: int) -> torch.nn.ModuleList:
    """The decoder's one ModuleList of layers (its `num_layers` blocks, or fewer once cut)."""
    lists = [m for m in base.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{type(base).__name__}: cannot tell which module list holds its layers")
    return lists[0]


def layer_of(model: Any, base: Any, path: str, num_layers: int) -> int | None:
    """The decoder layer holding the module at `path` (None: outside every layer)."""
    target = find_module(model, path)
    for i, layer in enumerate(decoder_layers(base, num_layers)):
        if any(m is target for m in layer.modules()):
            return i
    return None


def _path_layer(model: Any, base: Any, num_layers: int, path: str) -> int | None:
    """The layer a module path names by its index under the decoder's layer list (which the cut
    may have shortened, so the path need not exist any more); None: not under it."""
    layers = decoder_layers(base, num_layers)
    prefix = next((f"{n}." for n, m in model.named_modules() if m is layers), None)
    index = path[len(prefix) :].partition(".")[0] if prefix and path.startswith(prefix) else ""
    return int(index) if index.isdigit() else None


def _meta_model(config: Any) -> Any:
    """The model of `config` on the meta device (None: it cannot be built so; checked when it loads)."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (remote code, exotic configs: the worker's load finds a bad path)
        return None


def find_module(model: Any, path: str) -> torch.nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n][:6]
        raise ValueError(
            f"hook point {path!r}: {type(model).__name__} has no such module (its modules are named like "
            f"{', '.join(names)}, ...)"
        ) from None


def _child(layer: torch.nn.Module, names: tuple[str, ...], what: str, point: str) -> torch.nn.Module:
    for name in names:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(
        f"hook point {point!r}: {type(layer).__name__} has no {what} block named {' or '.join(names)}; "
        "name the module by its path instead"
    )


def first(output: Any) -> torch.Tensor:
    """A module's main output (a tensor, or the first of the tuple it returns)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _replace_first(output: Any, value: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (value, *output[1:])
    if isinstance(output, list):
        return [value, *output[1:]]
    return value


@dataclass
class Slots:
    """Where each row slot of one forward pass sits in its item's sequence ([rows, tokens] each)."""

    position: torch.Tensor  # its position in the item's sequence (prefix included)
    prefix_len: torch.Tensor  # its item's prefix length (prefix spans: larger than any position in them)
    # its item's token count (-1: a prefix span shared by several items); generate: its prompt's,
    # and the tokens it generated after them sit at positions from there on
    seq_len: torch.Tensor
    valid: torch.Tensor  # bool: a token (not padding)
    item: torch.Tensor | None = None  # its item in the batch (-1: padding; a shared prefix's: an item holding it)
    table: Any = None  # the batch's per-item parameters of row-dependent entries (forge.runtime.hooks.row_tables)

    @staticmethod
    def prefix(length: int, device: Any, table: Any = None) -> Slots:
        """A shared prefix run on its own: every slot is a prefix token (of the batch's first item)."""
        pos = torch.arange(length, device=device).view(1, length)
        one = torch.ones_like(pos, dtype=torch.bool)
        return Slots(pos, torch.full_like(pos, length + 1), torch.full_like(pos, -1), one, torch.zeros_like(pos), table)

    def span(self, span: Any) -> torch.Tensor:
        """bool [rows, tokens]: the slots an intervention's span covers."""
        own = self.valid & (self.position >= self.prefix_len) & (self.position < self.seq_len)  # not generated
        if span == "generated":  # past the item's own tokens (seq_len -1: a shared prefix span)
            return self.valid & (self.position >= self.seq_len) & (self.seq_len >= 0)
        if span == "text":
            return own
        if span == "prefix":
            return self.valid & (self.position < self.prefix_len)
        if span == "all":
            return self.valid
        if span == "last":
            return own & (self.position == self.seq_len - 1)
        wanted = torch.tensor(list(span), dtype=self.position.dtype, device=self.position.device)
        return self.valid & torch.isin(self.position, wanted)


class HookSet:
    """The hooks of one worker's model: captures and interventions at their points.

    `begin(slots, capture)` before each forward pass, `end()` after it returns what was captured
    ({point name: [rows, tokens, ...]}, or [rows, heads, queries, keys] for attention patterns)."""

    def __init__(self, model: Any, base: Any, num_layers: int, captures: list[str], interventions: list[Intervention]):
        self.captures = {p.name: p for p in (parse_point(c, num_layers) for c in captures)}
        self.interventions = interventions
        self.handles: list[Any] = []
        self._slots: Slots | None = None
        self._capturing = False
        self._masks: dict[Any, torch.Tensor] = {}
        self.captured: dict[str, torch.Tensor] = {}
        kept = len(decoder_layers(base, num_layers)) if interventions else num_layers
        points: dict[str, tuple[HookPoint, list[Intervention]]] = {}
        for name, point in self.captures.items():
            points.setdefault(name, (point, []))
        for iv in interventions:
            point = parse_point(iv.at, num_layers)
            layer = point.layer if point.kind != "module" else _path_layer(model, base, num_layers, iv.at)
            if layer is not None and layer >= kept:
                continue  # past the layers this worker runs: it changes nothing read
            points.setdefault(point.name, (point, []))[1].append(iv)
        for name, (point, ivs) in points.items():
            self._install(model, base, num_layers, point, ivs, name in self.captures)
        self.row_dependent = any(iv.row_dependent for _, ivs in points.values() for iv in ivs)
        self.patch_points = [p for name, (p, ivs) in points.items() if any(iv.op == "patch" for iv in ivs)]

    def _install(self, model, base, num_layers, point: HookPoint, ivs: list[Intervention], keep: bool) -> None:
        name = point.name
        if point.kind == "module":
            module, pre = find_module(model, name), False
        else:
            assert point.layer is not None  # a named point is at a layer
            layer = decoder_layers(base, num_layers)[point.layer]
            pre = point.kind in ("resid_pre", "mlp_in")
            if point.kind in ("resid_pre", "resid_post"):
                module = layer
            elif point.kind in ("attn_out", "attn_pattern"):
                module = _child(layer, ATTN_NAMES, "attention", name)
            elif any(isinstance(getattr(layer, n, None), torch.nn.Module) for n in MLP_NAMES):
                module = _child(layer, MLP_NAMES, "MLP", name)
            else:
                module = _child(layer, MLP_IN_LINEAR if pre else MLP_OUT_LINEAR, "MLP", name)
        pattern = point.kind == "attn_pattern"
        if pre:
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(name, ivs, keep), with_kwargs=True))
        else:
            self.handles.append(module.register_forward_hook(self._hook(name, ivs, keep, pattern)))

    # -- the hooks
    def _pre_hook(self, name: str, ivs: list[Intervention], keep: bool):
        def hook(module, args, kwargs):
            if args:
                value = args[0]
                new = self._apply(name, value, ivs, keep)
                return ((new, *args[1:]), kwargs) if new is not value else None
            value = kwargs["hidden_states"]
            new = self._apply(name, value, ivs, keep)
            return (args, {**kwargs, "hidden_states": new}) if new is not value else None

        return hook

    def _hook(self, name: str, ivs: list[Intervention], keep: bool, pattern: bool):
        def hook(module, args, output):
            if pattern:
                weights = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
                if weights is None:
                    raise ValueError(
                        f"hook point {name!r}: {type(module).__name__} gave no attention probabilities; "
                        "attention patterns need model.attn_implementation=eager"
                    )
                if self._capturing:
                    self.captured[name] = weights
                return None
            value = first(output)
            new = self._apply(name, value, ivs, keep)
            return _replace_first(output, new) if new is not value else None

        return hook

    def _apply(self, name: str, value: torch.Tensor, ivs: list[Intervention], keep: bool) -> torch.Tensor:
        slots = self._slots
        if slots is None:
            return value  # a forward pass Forge did not start (a probe): untouched
        shape = tuple(slots.position.shape)
        flat = value.dim() >= 2 and tuple(value.shape[:2]) != shape and value.shape[0] == shape[0] * shape[1]
        if flat:  # tokens flattened into one axis (OPT's MLP): [rows * tokens, ...]
            out = self._apply(name, value.view(*shape, *value.shape[1:]), ivs, keep)
            return out.view(value.shape) if out is not None else value
        if value.dim() < 2 or tuple(value.shape[:2]) != shape:
            raise ValueError(
                f"hook point {name!r}: its value has shape {tuple(value.shape)}, not one value per token "
                f"[{slots.position.shape[0]}, {slots.position.shape[1]}, ...]; choose a module inside a layer"
            )
        for iv in ivs:
            if iv.row_dependent:  # its parameters and tokens are each item's own
                if slots.table is None or slots.item is None:
                    raise ValueError(f"intervention at {iv.at!r}: this forward pass gave no per-item parameters")
                value = slots.table.apply(iv, value, slots)
                continue
            mask = self._masks.get((iv.span, value.device))  # a split model's layers are on several devices
            if mask is None:
                mask = self._masks[iv.span, value.device] = slots.span(iv.span).to(value.device)
            value = iv.apply(value, mask)
        if keep and self._capturing:
            self.captured[name] = value
        return value

    # -- one forward pass
    def begin(self, slots: Slots | None, capture: bool) -> None:
        self._slots, self._capturing, self._masks, self.captured = slots, capture, {}, {}

    def end(self) -> dict[str, torch.Tensor]:
        captured = self.captured
        self._slots, self._capturing, self._masks, self.captured = None, False, {}, {}
        return captured

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def patterns(self) -> bool:
        """Attention patterns are captured (they need the model's own attention on every layout)."""
        return any(p.kind == "attn_pattern" for p in self.captures.values())

    def run(
        self, forward: Any, slots: Slots | None, capture: bool, **inputs: Any
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """`forward(**inputs)` with the hooks told where each slot sits; (its output, what was captured)."""
        if not self.handles:
            return forward(**inputs), {}
        self.begin(slots, capture)
        try:
            out = forward(**inputs)
        finally:
            captured = self.end()
        return out, captured


def layers_read(model: Any, base: Any, num_layers: int, captures: Any) -> int:
    """Decoder layers a worker must keep for its captures (0: none; all of them for a module
    outside every layer)."""
    need = 0
    for name in captures or ():
        point = parse_point(name, num_layers)
        layer = point.layer if point.kind != "module" else layer_of(model, base, name, num_layers)
        need = max(need, num_layers if layer is None else layer + 1)
    return need


def row_slots(
    items: list[Any],
    tok: tuple[torch.Tensor, ...],
    rows: int,
    width: int,
    position_ids: torch.Tensor,
    prefix_spans: torch.Tensor | None = None,
    table: Any = None,
    span_items: torch.Tensor | None = None,
) -> Slots:
    """Slots of a forward pass over rows: each item's tokens where `tok` puts them (item, place,
    row, column), at `position_ids`; tree rows' prefix spans (`prefix_spans`, bool) are prefix tokens,
    each of the item `span_items` names there (one holding it)."""
    tok_item, _, tok_row, tok_col = tok
    prefix_len = torch.zeros(rows, width, dtype=torch.long)
    seq_len = torch.full((rows, width), -1, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    item = torch.full((rows, width), -1, dtype=torch.long)
    prefix_len[tok_row, tok_col] = torch.tensor([it.prefix_len for it in items], dtype=torch.long)[tok_item]
    seq_len[tok_row, tok_col] = torch.tensor([it.num_tokens for it in items], dtype=torch.long)[tok_item]
    valid[tok_row, tok_col] = True
    item[tok_row, tok_col] = tok_item
    if prefix_spans is not None:
        span = prefix_spans.cpu()
        valid |= span
        prefix_len[span] = position_ids[span] + 1  # a prefix token, in every item that shares the span
        if span_items is not None:
            item[span] = span_items.cpu()[span]
    return Slots(position_ids.clone(), prefix_len, seq_len, valid, item, table)


def check_points(
    captures: Any, interventions: Any, num_layers: int, attn: str, function: str, config: Any = None, generates=False
) -> None:
    """Refuse, before any work, hook points the model cannot have (ForgeError naming the point);
    module paths are looked up in the model built from `config` on the meta device (no weights). A
    span 'generated' is refused unless the function `generates` tokens."""
    from forge.errors import ForgeError

    if not generates and any(iv.span == "generated" for iv in interventions):
        raise ForgeError(f"{function}: intervene span 'generated' is for generate only; {function} generates none")

    for where, names in (("capture", captures), ("intervene", [iv.at for iv in interventions])):
        for name in names:
            try:
                point = parse_point(name, num_layers)
            except ValueError as exc:
                raise ForgeError(f"{function}: {where}: {exc}") from None
            if point.kind == "attn_pattern" and where == "intervene":
                raise ForgeError(f"{function}: intervene at {name!r}: attention patterns are read, not changed")
            if point.kind == "attn_pattern" and attn != "eager":
                raise ForgeError(
                    f"{function}: capture {name!r}: {attn} attention never forms the attention probabilities; "
                    "set model.attn_implementation=eager"
                )
    named = [*captures, *(iv.at for iv in interventions)]
    paths = [n for n in named if n.rpartition(".")[0] not in POINTS] if config is not None else []
    model = _meta_model(config) if paths else None
    for path in paths if model is not None else ():
        try:
            outside = hf_compat.outside_decoder(model, find_module(model, path))
        except ValueError as exc:
            raise ForgeError(f"{function}: {exc}") from None
        if outside is not None:  # the LM head and what else sits after the decoder never run there
            raise ForgeError(
                f"{function}: hook point {path!r} is outside the base decoder {outside!r}, the part of the model "
                f"Forge runs; name a module under {outside!r}"
            )
