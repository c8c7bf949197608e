"""Table output: Parquet shards committed through the run's journal, read back as one table.

    run_dir/<subdir>/shard-SSS-KKKKK.parquet   one row per item, columns of the function's schema
    run_dir/commits.jsonl                      one line per shard: file, index

Rows are buffered as batches finish and written a shard at a time (`RunStore.write_shard`:
the shard put in place whole, then its journal record), so a crash leaves no half shard and a
resumed run skips what was committed. `run_dir` is a local path or an fsspec URL. `load_table` reads only journaled shards and puts
rows back in input order (by `index`, the key each item is committed under).
"""

from __future__ import annotations

from typing import Any

from forge.errors import ForgeError
from forge.location import open_location
from forge.store import RunStore, read_journal

INDEX = "index"  # the column holding each row's commit key (Item.index)


class TableWriter:
    """Buffers rows (dicts of columns); `flush` commits them as one Parquet shard."""

    def __init__(self, store: RunStore, subdir: str, schema, rows_per_shard: int = 4096):
        import pyarrow as pa

        if INDEX not in schema.names:
            schema = schema.append(pa.field(INDEX, pa.int64()))
        self.store = store
        self.subdir = subdir
        self.schema = schema  # pyarrow.Schema of every shard
        self.rows_per_shard = rows_per_shard
        self.shards = 0  # written by this session
        self._names = 0  # shard names used by this session (failed writes included)
        self.rows_written = 0  # by this session
        self._columns: dict[str, list] = {name: [] for name in schema.names}

    def add(self, **columns: list) -> None:
        """Rows as equal-length lists per column (every schema column, `index` included)."""
        missing = set(self._columns) - set(columns)
        if missing:
            raise ValueError(f"table rows lack column(s) {sorted(missing)}")
        for name, values in columns.items():
            self._columns[name].extend(values)

    def flush(self) -> None:
        if not self._columns[INDEX]:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(self._columns, schema=self.schema)
        name = f"{self.subdir}/{self.store.shard_name(self._names, '.parquet')}"
        self._names += 1  # a failed write's name is not reused (a shard it left in place is an orphan)
        try:
            self.store.write_shard(name, lambda path: pq.write_table(table, str(path)),
                                   {INDEX: [int(i) for i in self._columns[INDEX]]})
            self.shards += 1
            self.rows_written += table.num_rows
        finally:  # a failed write commits nothing: its rows are dropped (the loop accounts them)
            self._columns = {name: [] for name in self.schema.names}

    def close(self) -> dict[str, Any]:
        self.flush()
        return {"table": self.store.url(self.subdir), "shards": self.shards, "rows": self.rows_written}


def load_table(run_dir, subdir: str):
    """Every committed row of `run_dir/subdir` as one pyarrow Table, in input order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = open_location(run_dir)
    if not where.files(subdir) and not where.exists("run.json"):  # a run that committed no rows yet reads as None
        raise ForgeError(f"{run_dir}: no {subdir}/ table; is this the run directory of a function that writes one?")

    def read(rel: str):
        path = where.local_file(rel)
        return pq.read_table(str(path) if path is not None else pa.BufferReader(where.read_bytes(rel)))

    parts = [read(line["file"]) for line in read_journal(run_dir) if line["file"].startswith(subdir + "/")]
    if not parts:
        return None
    table = pa.concat_tables(parts)
    return table.sort_by(INDEX)
