"""A resumed run reads its input from its last read mark (forge.io.read_marks), not from the start.

`start_reading` hands a function that can seek (a `ModelFunction` whose `seekable` is true: its
rows become records without state carried from row to row) where to start and where to tell its
positions, and admission the records passed over (`Seek`): records 0..C-1, all committed items,
as columns whose token counts are those the mark recorded. Any other function, or a run
directory that is not local, reads from the start, as before. Closing the admission (the run's
end) closes the marks and clears the function's settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from forge.core.admission import Seek
from forge.io.location import local_path
from forge.io.read_marks import ReadMarks
from forge.vocab.column_batch import ItemColumns
from forge.vocab.geometry import NO_PREFIX


def start_reading(function: Any, run_dir: Any, fingerprint: dict | None, committed) -> Seek | None:
    """Where `function` starts reading (None: at the start, with no marks kept)."""
    if hasattr(function, "resume_at"):
        function.resume_at = function.read_marks = None
    root = local_path(run_dir) if run_dir is not None and fingerprint is not None else None
    if root is None or not getattr(function, "seekable", False):
        return None
    marks = ReadMarks(Path(root), fingerprint)
    at = marks.seek(committed)

    def close() -> None:
        marks.close()
        function.resume_at = function.read_marks = None

    function.read_marks = marks.position
    if at is None:
        return Seek(None, marks.seen, close)
    rows, records, tokens = at
    function.resume_at = (rows, records)
    prefix = ItemColumns(
        np.arange(records, dtype=np.int64), tokens, np.full(records, NO_PREFIX, np.int64), [], np.zeros(1, np.int64)
    )
    return Seek(prefix, marks.seen, close)
