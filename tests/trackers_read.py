"""Read back what each tracker wrote inside a run directory, with the tracker's own reader
(tests/test_trackers.py and docs/trackers.md's examples): the figures a team would chart.

Each reader returns {"items/completed", "tokens/completed", "tokens/padding", "status", "steps"}:
the run's totals as the tracker holds them, its status, and the steps its per-batch points sit at.
"""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
from pathlib import Path

KEYS = ("items/completed", "tokens/completed", "tokens/padding")


def tensorboard(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out = {key: acc.Scalars(f"final/{key}")[-1].value for key in KEYS}
    out["status"] = acc.Tensors("final/status/text_summary")[-1].tensor_proto.string_val[0].decode()
    out["steps"] = [e.step for e in acc.Scalars("tokens/completed")]
    return out


def tensorboard_scalars(folder: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return acc.Scalars(tag)


def mlflow(run_dir: Path) -> dict:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "trackers" / "ids.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(run_dir / "trackers" / "mlflow").resolve().as_uri())
    run = client.get_run(run_id)
    out = {key: run.data.metrics[f"final/{key}"] for key in KEYS}
    out["status"] = run.data.tags["forge.status"]
    out["mlflow_status"] = run.info.status
    out["params"] = run.data.params
    out["steps"] = [m.step for m in client.get_metric_history(run_id, "tokens/completed")]
    return out


def _wandb_records(path: str):
    """The records of a run's .wandb file: a LevelDB-style log (32 KiB blocks of chunks with a
    7-byte header: crc32, length, type) after the file's own 7-byte header, ':W&B' first."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            yield chunk
        elif kind in (2, 3):  # first, middle
            pending += chunk
        elif kind == 4:  # last
            yield pending + chunk
            pending = b""


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb(run_dir: Path) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(glob.glob(str(run_dir / "trackers" / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    summary, steps, ids = {}, [], set()
    for path in files:  # a resumed run: one offline folder per session, one run id
        for data in _wandb_records(path):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                steps.append(row["tokens/completed"])
            elif kind == "summary":
                summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    out = {key: summary[f"final/{key}"] for key in KEYS}
    return {**out, "status": summary["status"], "steps": steps, "ids": ids, "sessions": len(files)}


def trackio(run_dir: Path) -> dict:
    db = sqlite3.connect(run_dir / "trackers" / "trackio" / "forge.db")
    try:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY step, id").fetchall()
    finally:
        db.close()
    last = json.loads(rows[-1][2])
    out = {key: last[f"final/{key}"] for key in KEYS}
    steps = [step for _, step, m in rows if "tokens/completed" in json.loads(m)]
    return {**out, "status": last["final/status"], "steps": steps, "names": {r[0] for r in rows}}


READERS = {"tensorboard": tensorboard, "mlflow": mlflow, "wandb": wandb, "trackio": trackio}
