"""What `forge.run` returns: a run's results read back (`forge.io.results.load`) as a table and
as tensors, with its dataset result and its report.

Rows are in input order, as `load` gives them. Numeric fields (activations, captures, scores)
are torch tensors, [rows, *shape]; a ragged field (one value per token) is a list of tensors,
one per row. `result[id]` is one row's values by its id."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from forge.errors import ForgeError
from forge.io.results import Results, load, result_folders

FAILURES = "failures.jsonl"  # the run directory's record of items that failed
SKIPPED = "skipped.jsonl"  # and of the rows it skipped (too long, a repeated id)


@dataclass
class Result:
    """A finished run: `table()` / `to_pandas()`, `tensors`, `result[id]`, `aggregate`, `report`."""

    run_dir: str  # the run directory (removed with the session when the call gave no output_dir)
    report: dict[str, Any]  # report.json: the token ledger, phases, devices, status
    results: Results | None  # the function's results folder read back (None: it committed nothing)
    folders: list[str] = field(default_factory=list)  # every results folder of the run (`folder(name)` reads one)
    failures: list[dict[str, Any]] = field(default_factory=list)  # failures.jsonl: each failed item's id and reason
    skipped: list[dict[str, Any]] = field(default_factory=list)  # skipped.jsonl: each skipped row's id and reason
    _folders: dict[str, Results] = field(default_factory=dict, repr=False)  # folders read (`read_folders`)

    @classmethod
    def read(cls, run_dir: str, report: dict[str, Any], folder: str | None, words=None) -> Result:
        """The run's results; `words` rewrites the ids and reasons of its failed and skipped rows
        (`forge.inproc.session.rows_words`: rows handed in are named by their place in the list)."""
        import warnings

        from forge.io.location import open_location

        folders = result_folders(run_dir)
        main = folder if folder in folders else (folders[0] if len(folders) == 1 else None)
        where = open_location(run_dir)
        found = {name: _records(where, name) for name in (FAILURES, SKIPPED)}
        if words is not None:
            found = {n: [{**r, **{k: words(r[k]) for k in ("id", "reason") if isinstance(r.get(k), str)}} for r in rs]
                     for n, rs in found.items()}  # fmt: skip
        for name, what in ((FAILURES, "failed"), (SKIPPED, "were skipped")):
            if found[name]:
                first = found[name][0]
                why = f"the first {first.get('id')!r}: {first.get('reason')}"
                attr = name.partition(".")[0]
                warnings.warn(f"{len(found[name])} item(s) {what} (result.{attr}), {why}", stacklevel=_caller())
        results = load(run_dir, main) if main else None
        return cls(str(run_dir), report, results, folders, found[FAILURES], found[SKIPPED])

    def read_folders(self) -> None:
        """Read every results folder now (`folder(name)` then needs no run directory)."""
        for name in self.folders:
            self._folders.setdefault(name, load(self.run_dir, name))

    def _loaded(self) -> Results:
        if self.results is None:
            raise ForgeError(f"{self.run_dir}: no results were committed (report status: {self.report.get('status')})")
        return self.results

    def __len__(self) -> int:
        return 0 if self.results is None else len(self.results)

    @property
    def ids(self) -> list[str]:
        return [] if self.results is None else self.results.ids

    @property
    def aggregate(self) -> dict[str, Any]:
        """The function's dataset result (its `Aggregate`s), {} when it declares none."""
        return {} if self.results is None else self.results.aggregate

    @property
    def meta(self) -> list[Any] | None:
        """Each row's meta (probe_gen's labels, ...) where the function keeps one."""
        return None if self.results is None else self.results.meta

    def table(self):
        """The rows as a pyarrow Table: id, index, then the fields."""
        return self._loaded().table()

    def to_pandas(self):
        """The rows as a pandas DataFrame (pandas must be installed)."""
        return self.table().to_pandas()

    @cached_property
    def tensors(self) -> dict[str, Any]:
        """Field -> a torch tensor [rows, *shape], or a list of tensors (ragged fields); text
        fields stay numpy arrays of strings."""
        return {name: _tensor(values) for name, values in self._loaded().columns.items()}

    def __getitem__(self, item_id: str | int) -> dict[str, Any]:
        """One row's values by its id (an integer as its text; for rows given without ids, their
        index: they go by "#<index>")."""
        rows = self._row_of
        key = str(item_id)
        if key not in rows and isinstance(item_id, int) and f"#{item_id}" in rows:
            key = f"#{item_id}"  # a row without an id of its own goes by "#<its index>"
        if key not in rows:
            raise KeyError(f"no row with id {key!r} in {self.run_dir}")
        return {name: values[rows[key]] for name, values in self.tensors.items()}

    @cached_property
    def _row_of(self) -> dict[str, int]:
        return {i: n for n, i in enumerate(self.ids)}

    def folder(self, name: str) -> Results:
        """Another results folder of the run (probe_gen's `prefix_states`, ...), read whole."""
        if name not in self.folders:
            raise ForgeError(f"{self.run_dir}: no results folder {name!r}; folders: {', '.join(self.folders)}")
        if name in self._folders:
            return self._folders[name]
        import os

        if not os.path.isdir(self.run_dir) and "://" not in self.run_dir:
            raise ForgeError(
                f"{self.run_dir}: the run directory was removed with its forge.Session; read folder({name!r}) "
                "before the session closes, or give the call an output_dir"
            )
        return load(self.run_dir, name)

    def __repr__(self) -> str:
        fields = ", ".join(self.results.columns) if self.results is not None else "-"
        return f"Result({len(self)} rows [{fields}], status={self.report.get('status')}, run_dir={self.run_dir!r})"


def _records(where, name: str) -> list[dict[str, Any]]:
    import json

    lines = where.read_bytes(name).decode().splitlines() if where.exists(name) else []
    return [json.loads(line) for line in lines if line.strip()]


def _caller() -> int:
    """The `stacklevel` of the first frame outside Forge's in-process API (forge.inproc, forge.eval),
    seen from the function that calls this: where a warning is the user's."""
    import os
    import sys

    ours = tuple(os.path.join(os.path.dirname(os.path.dirname(__file__)), p) for p in ("inproc", "eval"))
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


def _tensor(values):
    import numpy as np
    import torch

    if values.dtype != object:
        return torch.from_numpy(np.require(values, requirements=["C", "W"]))
    if len(values) and all(isinstance(v, np.ndarray) and v.dtype != object for v in values):
        return [torch.from_numpy(np.require(v, requirements=["C", "W"])) for v in values]
    return values
