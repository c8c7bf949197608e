"""Forge's fidelity guarantee for your own function: every batching mode equals one item at a time.

Model: `check_modes` writes the given rows to a JSONL file, runs the function over them once
one item at a time (`batching=item`, one item per batch, no prefix cache: the reference),
then in every batching mode of `MODES` (item batches, token batches with the prefix cache on
and off, packed rows, memory-sized batches, merged tree rows), each through the normal
`forge run` path in this process, and compares each mode's results with the reference item by
item: numeric fields within `tol` (absolute), everything else exactly. A mode the model cannot
run exactly is refused by Forge before any work; `check_modes` reports it as refused rather
than failing. Every row must run in every run: a row the limits skip (longer than
`max_seq_len`, say) fails the check, naming it and the limits, unless `allow_skipped=True`,
which compares the rows that ran and reports the rest. The returned `ModeCheck` says which
layouts each mode actually ran (`layouts`; `summary()` puts it all in a few lines).

    from forge.testing import check_modes

    def test_my_function_is_exact(tmp_path):
        check = check_modes("my_function", rows, tmp_path, tol=1e-5, overrides=["model.name=embedded:tiny-llama"])
        print(check.summary())
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from forge.errors import ForgeError

if TYPE_CHECKING:
    from forge.driver.report import Report

__all__ = ["MODES", "ONE_AT_A_TIME", "REFERENCE", "SMALL_LIMITS", "ModeCheck", "check_modes", "compare", "run_function"]

ONE_AT_A_TIME = ["batching=item", "batching.batch_size=1"]  # whole prompts, one per batch, no cache
MODES: dict[str, list[str]] = {
    "item": ["batching=item", "batching.batch_size=6"],
    # prefix groups kept apart, so that each layout runs whatever the input's geometry ...
    "token-cache": ["batching=token", "batching.merge_groups=false"],
    "token-nocache": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": [
        "batching=token",
        "batching.packing=packed",
        "batching.packed_row_tokens=64",
        "batching.merge_groups=false",
    ],
    "memory": ["batching=memory", "devices.cpu_memory_gb=0.03", "batching.merge_groups=false"],
    # ... and merged into tree rows: a step costs so much that every small prefix group merges
    "token-merged": ["batching=token", "batching.batch_overhead_tokens=100000"],
}
# small steps, so that a few rows make several batches of several items
SMALL_LIMITS = [
    "devices=auto",
    "devices.limits.max_batch_tokens=256",
    "devices.limits.max_seq_len=128",
    "budget.tokens_per_step=256",
]


REFERENCE = "one-at-a-time"  # the reference run's name in `ModeCheck.layouts` and `ModeCheck.skipped`


@dataclass
class ModeCheck:
    """What `check_modes` found: each mode's largest difference from the reference, or why it was
    refused, the layouts each run's batches took and the rows each run skipped."""

    reference: Any  # forge.io.results.Results of the one-item-at-a-time run
    results: dict[str, Any] = field(default_factory=dict)  # mode -> its Results
    worst: dict[str, float] = field(default_factory=dict)  # mode -> largest absolute difference over numeric fields
    refused: dict[str, str] = field(default_factory=dict)  # mode -> Forge's one-line refusal
    # run (REFERENCE, then each mode that ran) -> its completed batches per layout, as the report
    # counts them: rows, packed rows, split-prefix rows, cache-hit rows, tree rows (forge.core.layouts)
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: dict[str, dict[str, str]] = field(default_factory=dict)  # run -> {row id: why}, runs that skipped any

    def summary(self) -> str:
        """A few lines a person reads: per run, the layouts it ran, its worst difference or why
        it was refused, and the rows it skipped."""
        lines = [f"{REFERENCE}: {len(self.reference)} rows compared; {_layouts(self.layouts.get(REFERENCE))}"]
        for mode in self._modes():
            if mode in self.refused:
                lines.append(f"{mode}: refused: {self.refused[mode]}")
                continue
            worst = self.worst.get(mode)
            lines.append(f"{mode}: {_layouts(self.layouts.get(mode))}; worst difference {worst:.3g}")
        runs = [REFERENCE, *self._modes()]
        skips = list(self.skipped.values())
        if skips and len(skips) == len(runs) - len(self.refused) and all(s == skips[0] for s in skips):
            lines.append(f"every run skipped {len(skips[0])} row(s): {_skip_list(skips[0])}")
        else:
            for run, rows in self.skipped.items():
                lines.append(f"{run} skipped {len(rows)} row(s): {_skip_list(rows)}")
        return "\n".join(lines)

    def _modes(self) -> list[str]:
        """Every mode checked: those that ran, in order, then those refused."""
        return [m for m in {**self.layouts, **self.refused} if m != REFERENCE]


def _layouts(layouts: dict[str, int] | None) -> str:
    return ", ".join(f"{name} x{n}" for name, n in (layouts or {}).items()) or "no batches"


def _skip_list(rows: dict[str, str], most: int = 10) -> str:
    """`'a', 'b' (why)`, ids grouped by reason; the first `most` ids."""
    by_reason: dict[str, list[str]] = {}
    for rid, why in rows.items():
        by_reason.setdefault(why, []).append(rid)
    parts = []
    for why, ids in by_reason.items():
        shown = ", ".join(repr(i) for i in ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")
        parts.append(f"{shown} ({why})")
    return "; ".join(parts)


_COMPOSED: dict[tuple, Any] = {}


def run_function(function: str, rows_path: Path, run_dir: Path | str, overrides: Sequence[str] = ()) -> Report:
    """`forge run function=<function>` in this process (`run_dir`: a path or an fsspec URL); returns the report."""
    from forge.cli.build import build_spec
    from forge.cli.compose import compose
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    key = (function, str(rows_path), tuple(overrides))
    if key not in _COMPOSED:  # Hydra composes each configuration once
        _COMPOSED[key] = compose(
            [f"function={function}", f"input.path={rows_path}", "runtime.executor=inprocess", *overrides]
        )
    from forge.io.location import local_path

    spec = build_spec(copy.deepcopy(_COMPOSED[key]), local_path(run_dir) or str(run_dir))
    return execute(spec, make_plugin_manager(modules=spec.plugins))


def compare(got: Any, want: Any, tol: float) -> float:
    """Largest absolute difference between two Results (same ids, same fields); AssertionError if
    ids, non-numeric values or shapes differ, or a numeric difference exceeds `tol`."""
    assert got.ids == want.ids, f"ids differ: {got.ids[:5]}... vs {want.ids[:5]}..."
    worst = 0.0
    for name, ref in want.columns.items():
        val = got.columns[name]
        if isinstance(ref, np.ndarray) and ref.dtype != object and np.issubdtype(ref.dtype, np.number):
            assert val.shape == ref.shape, f"{name}: shape {val.shape} vs {ref.shape}"
            diff = float(np.max(np.abs(val.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
            assert diff <= tol, f"{name}: differs by {diff:.3g} > tol={tol:g}"
            worst = max(worst, diff)
        else:
            for k, (a, b) in enumerate(zip(list(val), list(ref))):
                if isinstance(b, np.ndarray):  # ragged: one array per item
                    assert a.shape == b.shape, f"{name}[{k}]: shape {a.shape} vs {b.shape}"
                    d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if b.size else 0.0
                    assert d <= tol, f"{name}[{k}]: differs by {d:.3g} > tol={tol:g}"
                    worst = max(worst, d)
                else:
                    assert a == b, f"{name}[{k}]: {a!r} vs {b!r}"
    return worst


def check_modes(
    function: str,
    rows: Sequence[dict],
    work_dir: Path,
    *,
    tol: float,
    overrides: Sequence[str] = (),
    modes: dict[str, list[str]] | None = None,
    limits: Sequence[str] = tuple(SMALL_LIMITS),
    allow_skipped: bool = False,
) -> ModeCheck:
    """Run `function` over `rows` one item at a time and in every mode of `modes` (default:
    `MODES`) under `limits` (default: `SMALL_LIMITS`, small steps; `max_seq_len=128`) plus
    `overrides`; assert each mode equals the one-item-at-a-time results within `tol`.

    Every row must run in every run: a row a run skips (longer than the limits allow, over a
    budget, a repeated id) or fails raises AssertionError naming the rows, why and the limits in
    force, unless `allow_skipped=True`: then each mode is compared on the rows both it and the
    reference ran, and `ModeCheck.skipped` lists the rest. A mode Forge refuses as not exact
    for the model is reported in `ModeCheck.refused`. Returns what was found: differences,
    refusals, skipped rows and the layouts each run's batches took (`ModeCheck.summary()`)."""
    from forge.io.results import load

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    rows_path = work_dir / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function(function, rows_path, work_dir / REFERENCE, [*limits, *ONE_AT_A_TIME, *overrides])
    check = ModeCheck(load(work_dir / REFERENCE))
    _note_run(check, REFERENCE, report, work_dir / REFERENCE, len(rows), [*limits, *overrides], allow_skipped)
    assert len(check.reference), "the one-item-at-a-time run committed nothing"
    for mode, options in (MODES if modes is None else modes).items():
        try:
            report = run_function(function, rows_path, work_dir / mode, [*limits, *options, *overrides])
        except ForgeError as exc:  # a mode that cannot be exact for this model is refused before work
            if "not exact" not in str(exc):
                raise
            check.refused[mode] = str(exc)
            continue
        _note_run(check, mode, report, work_dir / mode, len(rows), [*limits, *options, *overrides], allow_skipped)
        assert report["balanced"], (mode, report.get("imbalance"))
        check.results[mode] = load(work_dir / mode)
        got, want = _common(check.results[mode], check.reference)
        try:
            check.worst[mode] = compare(got, want, tol)
        except AssertionError as exc:
            raise AssertionError(f"batching mode {mode}: {exc}") from None
    return check


def _note_run(
    check: ModeCheck, run: str, report: Report, run_dir: Path, total: int, given: list[str], allow_skipped: bool
) -> None:
    """Keep a run's layouts and skipped rows; AssertionError if it failed rows, or skipped some
    while skips are not allowed."""
    failures = report.get("failures") or []
    assert report["items"]["failed"] == 0, (
        f"{run}: {report['items']['failed']} of {total} rows failed, e.g. "
        + "; ".join(f"{f['id']!r}: {f['reason']}" for f in failures[:5])
    )
    check.layouts[run] = dict(report.get("layouts") or {})
    skipped = _skipped(report, run_dir)
    if not skipped:
        return
    check.skipped[run] = skipped
    limits = {o.split("=")[0]: o for o in given if "limits." in o or "budget." in o or o.startswith("too_long")}
    assert allow_skipped, (
        f"check_modes: the {run} run skipped {len(skipped)} of {total} rows, so "
        f"{'no mode compared them' if run == REFERENCE else 'they were not compared'}: {_skip_list(skipped)}. "
        f"Limits in force: {', '.join(limits.values()) or 'the defaults'}. Pass larger "
        "limits (limits=[..., 'devices.limits.max_seq_len=N', 'devices.limits.max_batch_tokens=N', "
        "'budget.tokens_per_step=N']) or shorter rows, or allow_skipped=True to compare only the rows that ran"
    )


def _skipped(report: Report, run_dir: Path) -> dict[str, str]:
    """{row id: why} of the rows a run skipped (its skipped.jsonl; the report's counts if it has none)."""
    if not report["items"].get("skipped"):
        return {}
    path = run_dir / "skipped.jsonl"
    if path.is_file():
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {str(r["id"]): str(r["reason"]) for r in lines}
    return {f"({n} rows)": why for why, n in (report.get("skipped_reasons") or {}).items()}


def _common(got: Any, want: Any) -> tuple[Any, Any]:
    """Both Results cut to the ids both hold (all of them unless a run skipped rows)."""
    if got.ids == want.ids:
        return got, want
    both = set(got.ids) & set(want.ids)
    return _only(got, both), _only(want, both)


def _only(res: Any, ids: set[str]) -> Any:
    keep = [k for k, i in enumerate(res.ids) if i in ids]
    return dataclasses.replace(
        res,
        ids=[res.ids[k] for k in keep],
        index=res.index[keep],
        columns={name: values[keep] for name, values in res.columns.items()},
        meta=None if res.meta is None else [res.meta[k] for k in keep],
    )
