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


@dataclass
class Result:
    """A finished run: `table()` / `to_pandas()`, `tensors`, `result[id]`, `aggregate`, `report`."""

    run_dir: str  # the run directory (removed with the session when the call gave no output_dir)
    report: dict[str, Any]  # report.json: the token ledger, phases, devices, status
    results: Results | None  # the function's results folder read back (None: it committed nothing)
    folders: list[str] = field(default_factory=list)  # every results folder of the run (`folder(name)` reads one)
    failures: list[dict[str, Any]] = field(default_factory=list)  # failures.jsonl: each failed item's id and reason

    @classmethod
    def read(cls, run_dir: str, report: dict[str, Any], folder: str | None) -> Result:
        import json
        import warnings

        from forge.io.location import open_location

        folders = result_folders(run_dir)
        main = folder if folder in folders else (folders[0] if len(folders) == 1 else None)
        where = open_location(run_dir)
        lines = where.read_bytes(FAILURES).decode().splitlines() if where.exists(FAILURES) else []
        failures = [json.loads(line) for line in lines if line.strip()]
        if failures:
            first = failures[0]
            why = f"the first {first.get('id')!r}: {first.get('reason')}"
            warnings.warn(f"{len(failures)} item(s) failed (result.failures), {why}", stacklevel=3)
        return cls(str(run_dir), report, load(run_dir, main) if main else None, folders, failures)

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
        return load(self.run_dir, name)

    def __repr__(self) -> str:
        fields = ", ".join(self.results.columns) if self.results is not None else "-"
        return f"Result({len(self)} rows [{fields}], status={self.report.get('status')}, run_dir={self.run_dir!r})"


def _tensor(values):
    import numpy as np
    import torch

    if values.dtype != object:
        return torch.from_numpy(np.require(values, requirements=["C", "W"]))
    if len(values) and all(isinstance(v, np.ndarray) and v.dtype != object for v in values):
        return [torch.from_numpy(np.require(v, requirements=["C", "W"])) for v in values]
    return values
