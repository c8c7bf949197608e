"""Forge's fidelity guarantee for your own function: every batching mode equals one item at a time.

Model: `check_modes` writes the given rows to a JSONL file, runs the function over them once
one item at a time (`batching=item`, one item per batch, no prefix cache: the reference),
then in every batching mode of `MODES` (item batches, token batches with the prefix cache on
and off, packed rows, memory-sized batches), each through the normal `forge run` path in this
process, and compares each mode's results with the reference item by item: numeric fields
within `tol` (absolute), everything else exactly. A mode the model cannot run exactly is
refused by Forge before any work; `check_modes` reports it as refused rather than failing.

    from forge.testing import check_modes

    def test_my_function_is_exact(tmp_path):
        check_modes("my_function", rows, tmp_path, tol=1e-5, overrides=["model.name=embedded:tiny-llama"])
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from forge.errors import ForgeError

if TYPE_CHECKING:
    from forge.driver.report import Report

__all__ = ["MODES", "ONE_AT_A_TIME", "SMALL_LIMITS", "ModeCheck", "check_modes", "compare", "run_function"]

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


@dataclass
class ModeCheck:
    """What `check_modes` found: each mode's largest difference from the reference, or why it was refused."""

    reference: Any  # forge.io.results.Results of the one-item-at-a-time run
    results: dict[str, Any] = field(default_factory=dict)  # mode -> its Results
    worst: dict[str, float] = field(default_factory=dict)  # mode -> largest absolute difference over numeric fields
    refused: dict[str, str] = field(default_factory=dict)  # mode -> Forge's one-line refusal


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
) -> ModeCheck:
    """Run `function` over `rows` one item at a time and in every mode; assert each mode equals
    the one-item-at-a-time results within `tol`. Returns what was found (differences, refusals)."""
    from forge.io.results import load

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    rows_path = work_dir / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function(function, rows_path, work_dir / "one-at-a-time", [*limits, *ONE_AT_A_TIME, *overrides])
    assert report["items"]["failed"] == 0, report.get("failures")
    check = ModeCheck(load(work_dir / "one-at-a-time"))
    assert len(check.reference), "the one-item-at-a-time run committed nothing"
    for mode, options in (MODES if modes is None else modes).items():
        try:
            report = run_function(function, rows_path, work_dir / mode, [*limits, *options, *overrides])
        except ForgeError as exc:  # a mode that cannot be exact for this model is refused before work
            if "not exact" not in str(exc):
                raise
            check.refused[mode] = str(exc)
            continue
        assert report["items"]["failed"] == 0, (mode, report.get("failures"))
        assert report["balanced"], (mode, report.get("imbalance"))
        check.results[mode] = load(work_dir / mode)
        try:
            check.worst[mode] = compare(check.results[mode], check.reference, tol)
        except AssertionError as exc:
            raise AssertionError(f"batching mode {mode}: {exc}") from None
    return check
