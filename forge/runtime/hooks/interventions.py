"""Interventions: a function's `intervene:` entries, checked, with their vectors loaded.

An entry (`InterventionConfig`, one per list element of the function's ``intervene:`` key):

    intervene:
      - at: resid_post.2        # a hook point (forge.runtime.hooks.points): a Forge name or a module path
        op: add                 # add: value + scale * vector (steering) | set: the vector instead
                                # (patching a stored activation; mean ablation with a stored mean) | zero
        vector: dirs.npy        # add/set: a list of numbers, or a file: .npy, .pt, .safetensors#key,
                                # or a run's dataset result: run:<run dir>#<name>[/<label>]
        scale: 4.0              # add: the multiple of the vector added
        span: text              # text (the item's own tokens) | prefix | all | last (its last own
                                # token) | [positions] (from the sequence's first token, prefix included;
                                # a negative one counts from its end: -1 is the last token)
                                # | generated (generate: each generated token as it is fed back)

Per-row parameters (`forge.runtime.hooks.row_steer`): a value ``row.<column>`` is read from each input
row, so one run holds a sweep or a set of patching pairs:

      - {at: resid_post.2, op: add, vector: dirs.npy, scale: row.scale}      # a scale per row
      - {at: resid_post.2, op: add, vector: dirs.npy, index: row.dir}        # a row of a [k, hidden] file
      - {at: resid_post.2, op: patch, source: row.clean_id, span: [-1]}      # the source row's activation
      - {at: resid_post.2, op: patch, source: row.clean_id, span: row.pos}   # positions per row

Every layout applies an entry to the same tokens (`forge.runtime.hooks.points.Slots`), so results stay
equal to a plain one-prompt forward pass with the same hook. An entry that can reach prefix
tokens (span prefix, all or positions) changes the prefix's keys, so the function's prefix keys
carry the interventions' fingerprint (`Interventions.key`): a cached unsteered prefix is never
served to a steered item.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forge.errors import ForgeError

OPS = ("add", "set", "zero", "patch")
SPANS = ("text", "prefix", "all", "last", "generated")  # generated: the tokens generate feeds back (generate only)
WIDE_POINTS = ("resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_out")  # one hidden-size vector per token
ROW = "row."  # a value read from each input row: row.<column>


@dataclass
class InterventionConfig:
    """One ``intervene:`` entry as written in YAML (checked by `load_interventions`)."""

    at: str = ""  # the hook point: resid_pre.L, resid_post.L, attn_out.L, mlp_in.L, mlp_out.L or a module path
    op: str = "add"  # add (steering) | set (the given vector) | zero | patch (a source row's own activation)
    vector: Any = None  # add/set: numbers, or a file (.npy, .pt, .safetensors#key) or run:<dir>#<name>[/<label>]
    scale: Any = 1.0  # add: the multiple of the vector added (row.<column>: each row's own)
    span: Any = "text"  # text | prefix | all | last | positions (from 0; negative: from the end) | row.<column>
    index: Any = None  # add/set with a [k, hidden] vector file: which of its rows (row.<column>: each row's own)
    source: Any = None  # patch: the id of the row whose activation is patched in (row.<column>: each row's own)


@dataclass(frozen=True)
class Intervention:
    """One checked intervention; `apply` changes a hook point's value on the masked slots."""

    at: str
    op: str
    vector: tuple[float, ...] | None  # add/set: the vector (the value's last dimension)
    scale: float
    span: str | tuple[int, ...]
    rows: tuple[tuple[str, str], ...] = ()  # (parameter, input column) read per row: scale, index, source, span
    table: tuple[tuple[float, ...], ...] | None = None  # the [k, width] vectors a per-row index picks from
    source: str | None = None  # patch: one source row id for every row (None: per row, or no patch)
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def column(self, parameter: str) -> str | None:
        """The input column a parameter is read from per row (None: the entry's own value)."""
        return dict(self.rows).get(parameter)

    @property
    def row_dependent(self) -> bool:
        """Its parameters or its tokens depend on the row: per-row values, a patch or positions
        counted from the end (`forge.runtime.hooks.row_tables` applies it)."""
        negative = isinstance(self.span, tuple) and any(p < 0 for p in self.span)
        return bool(self.rows) or self.op == "patch" or negative

    def apply(self, value: Any, mask: Any) -> Any:
        """`value` [rows, tokens, ...] with this intervention on the slots where `mask` [rows, tokens]."""
        import torch

        m = mask.view(*mask.shape, *([1] * (value.dim() - 2)))
        if self.op == "zero":
            return value.masked_fill(m, 0)
        vec = self.vector_tensor(value)
        if self.op == "add":
            return torch.where(m, value + self.scale * vec, value)
        return torch.where(m, vec.expand_as(value), value)

    def describe(self) -> dict[str, Any]:
        digest = (
            None if self.vector is None else hashlib.sha256(np.asarray(self.vector, np.float64).tobytes()).hexdigest()
        )
        span = list(self.span) if isinstance(self.span, tuple) else self.span
        out = {"at": self.at, "op": self.op, "scale": self.scale, "span": span, "vector_sha256": digest}
        if self.table is not None:
            out["table_sha256"] = hashlib.sha256(np.asarray(self.table, np.float64).tobytes()).hexdigest()
        return {
            **out,
            **({"per_row": dict(self.rows)} if self.rows else {}),
            **({"source": self.source} if self.source is not None else {}),
        }

    @property
    def touches_prefix(self) -> bool:
        return self.span in ("prefix", "all") or isinstance(self.span, tuple) or self.column("span") is not None

    def vector_tensor(self, value: Any, index: Any = None) -> Any:
        """The vector (or, with `index` [...]: the table's rows) as a tensor like `value`, kept per device."""
        import torch

        key = (value.device, value.dtype, index is not None)
        vec = self._cache.get(key)
        if vec is None:
            source = self.vector if index is None else self.table
            vec = self._cache[key] = torch.tensor(source, dtype=value.dtype, device=value.device)
        if vec.shape[-1] != value.shape[-1]:
            raise ValueError(
                f"intervention at {self.at!r}: its vector has {vec.shape[-1]} values, the hook point's value "
                f"has {value.shape[-1]} per token"
            )
        return vec if index is None else vec[index]


@dataclass(frozen=True)
class Interventions:
    """A function's interventions, in the order they apply at each point."""

    items: tuple[Intervention, ...] = ()

    def fingerprint(self) -> list[dict[str, Any]]:
        return [iv.describe() for iv in self.items]

    @property
    def row_dependent(self) -> bool:
        """Some entry reads its rows (`Intervention.row_dependent`): items carry their own parameters."""
        return any(iv.row_dependent for iv in self.items)

    @property
    def checks_rows(self) -> bool:
        """Each item is checked against its entries (positions past its end fail it), or carries its own."""
        return self.row_dependent or any(isinstance(iv.span, tuple) for iv in self.items)

    @property
    def key(self) -> str | None:
        """What the prefix keys carry (None: no intervention reaches a prefix token)."""
        if not any(iv.touches_prefix for iv in self.items):
            return None
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return "iv-" + hashlib.sha256(blob).hexdigest()[:16]

    def __bool__(self) -> bool:
        return bool(self.items)

    def check_widths(self, hidden_size: int, function: str, where: str = "intervene") -> None:
        """Refuse, before any work, a vector whose length is not the model's hidden size at a
        named point (each holds one hidden-size vector per token). A module path's width is known
        only once it runs: there a wrong length fails the batch's items, with the reason."""
        for k, iv in enumerate(self.items):
            kind = iv.at.rpartition(".")[0]
            width = len(iv.vector) if iv.vector is not None else len(iv.table[0]) if iv.table else None
            if width is not None and kind in WIDE_POINTS and width != hidden_size:
                raise ForgeError(
                    f"{function}: {where}[{k}] at {iv.at!r}: its vector has {width} values, but the "
                    f"model's hidden size is {hidden_size}"
                )


def load_interventions(entries: Any, where: str = "intervene") -> Interventions:
    """The ``intervene:`` list checked and its vectors loaded (ForgeError naming the entry otherwise)."""
    out = []
    for k, raw in enumerate(entries or ()):
        get = raw.get if isinstance(raw, dict) else lambda name, default=None, r=raw: getattr(r, name, default)
        at, op = str(get("at", "") or ""), str(get("op", "add"))
        name = f"{where}[{k}]"
        if not at:
            raise ForgeError(f"{name}.at is missing: name a hook point such as resid_post.2 or mlp_out.1")
        if op not in OPS:
            raise ForgeError(f"{name}.op={op!r}; choose one of: {', '.join(OPS)}")
        rows = [(key, col) for key in ("scale", "index", "source", "span") if (col := _column(get(key), name, key))]
        per_row = dict(rows)
        span = f"{ROW}{per_row['span']}" if "span" in per_row else _span(get("span", "text"), name)
        vector, table, source = _values(get, name, op, per_row)
        if "scale" in per_row and op != "add":
            raise ForgeError(f"{name}.scale={get('scale')!r}: a scale applies to op=add only")
        try:
            scale = 1.0 if "scale" in per_row else float(get("scale", 1.0))
        except (TypeError, ValueError):
            raise ForgeError(
                f"{name}.scale={get('scale')!r}: expected a number, or {ROW}<column> (each row's own)"
            ) from None
        out.append(Intervention(at, op, vector, scale, span, tuple(rows), table, source))
    return Interventions(tuple(out))


def _column(value: Any, name: str, key: str) -> str | None:
    """The input column of a ``row.<column>`` value (None: not one)."""
    if not isinstance(value, str) or not value.startswith(ROW):
        return None
    column = value[len(ROW) :]
    if not column:
        raise ForgeError(f"{name}.{key}={value!r}: name the input column after {ROW} (say {ROW}{key})")
    return column


def _values(get: Any, name: str, op: str, per_row: dict[str, str]) -> tuple[Any, Any, str | None]:
    """(vector, table, source) of an entry: what op takes, checked."""
    index, source = get("index"), get("source")
    if op != "patch" and source is not None:
        raise ForgeError(f"{name}.source={source!r}: a source row is patched in by op=patch only")
    if op in ("zero", "patch") and index is not None:
        raise ForgeError(f"{name}.index={index!r}: op={op} takes no vector, so no index")
    if op == "zero":
        return None, None, None
    if op == "patch":
        if get("vector") is not None:
            raise ForgeError(f"{name}.vector: op=patch takes the source row's own activation; drop the vector")
        if source is None or (not isinstance(source, (str, int)) or isinstance(source, bool)):
            raise ForgeError(f"{name}.source is missing: op=patch needs {ROW}<column> (or one row's id)")
        return None, None, None if "source" in per_row else str(source)
    if index is None:
        return _vector(get("vector"), name, op), None, None
    values = _array(get("vector"), name, op)
    if values.ndim != 2 or not values.size or not np.isfinite(values).all():
        raise ForgeError(f"{name}.vector: index picks a row of a [k, width] table of finite values, got {values.shape}")
    table = tuple(tuple(float(v) for v in row) for row in values)
    if "index" in per_row:
        return None, table, None
    try:
        at = _position(index)
    except (TypeError, ValueError):
        at = -1
    if not 0 <= at < len(table):
        raise ForgeError(
            f"{name}.index={index!r}: give a row of the vector file, 0..{len(table) - 1}, or {ROW}<column>"
        )
    return table[at], None, None


def _span(span: Any, name: str) -> str | tuple[int, ...]:
    if isinstance(span, str):
        if span not in SPANS:
            raise ForgeError(
                f"{name}.span={span!r}; choose one of: {', '.join(SPANS)}, a list of positions or {ROW}<column>"
            )
        return span
    try:
        positions = tuple(_position(p) for p in span)
    except (TypeError, ValueError):
        raise ForgeError(f"{name}.span={span!r}; choose one of: {', '.join(SPANS)}, or a list of positions") from None
    if not positions:
        raise ForgeError(f"{name}.span=[]: name at least one position (or span: all)")
    return positions


def _position(p: Any) -> int:
    """A whole number (2 or 2.0), never a bool or 2.5."""
    if isinstance(p, bool) or not float(p).is_integer():
        raise ValueError(p)
    return int(p)


def _vector(source: Any, name: str, op: str) -> tuple[float, ...]:
    values = _array(source, name, op)
    if values.ndim != 1 or not values.size or not np.isfinite(values).all():
        raise ForgeError(f"{name}.vector: need one finite vector (1-D), got shape {values.shape}")
    return tuple(float(v) for v in values)


def _array(source: Any, name: str, op: str) -> np.ndarray:
    if source is None:
        raise ForgeError(f"{name}.vector is missing: op={op} needs a vector (numbers or a file)")
    if isinstance(source, str):
        return read_vector(source, name)
    try:
        return np.asarray([list(v) if not np.isscalar(v) else v for v in source], dtype=np.float64)
    except (TypeError, ValueError):
        raise ForgeError(f"{name}.vector: give a list of numbers or a file path") from None


def read_vector(source: str, name: str) -> np.ndarray:
    """A vector from a file (.npy, .pt, .safetensors#key) or a run's dataset result (run:<dir>#<name>[/<label>])."""
    path, _, key = source.partition("#")
    try:
        if path.startswith("run:"):
            from forge.io.results import aggregate

            what, _, label = key.partition("/")
            value: Any = aggregate(path[4:])[what]
            if label:
                value = {str(k): v for k, v in value.items()}[label]
            return np.asarray(value, np.float64)
        if path.endswith(".npy"):
            return np.load(path).astype(np.float64)
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file

            tensors = load_file(path)
            return np.asarray(tensors[key] if key else next(iter(tensors.values())), np.float64)
        if path.endswith(".pt"):
            import torch

            return torch.load(path, map_location="cpu", weights_only=True).double().numpy()
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ForgeError(f"{name}.vector={source!r}: {type(exc).__name__}: {exc}") from None
    raise ForgeError(f"{name}.vector={source!r}: use a .npy, .pt or .safetensors#key file, or run:<dir>#<name>")
