"""Input from a Hugging Face dataset against the same rows from JSONL (issue 47): reading, checking and tokenizing.

    python -m benchmarks datasets [--rows 20000] [--rounds 3] [--only 1,2,...] [--out result.md]

The rows are the embedded statements (text, few-shot prefix, label), repeated to `--rows` with
unique ids, written once as JSONL under Forge's names, and with the dataset's own names
(`sentence`, `shots`, `uid`) as a `save_to_disk` folder and a JSON file for the `json` builder
(mapped back with `input.columns`). Each variant is a child process that builds `probe_gen` on
that input as `forge run` does (`forge.cli.build.build_spec`: the input opened and checked, its
ids scanned, its rows counted), then takes the input's fingerprint and reads every record
(rows read, checked and tokenized: `function.records()`), the work where the inputs differ;
the model's forward pass is the same for every input and is not run. The function is built
first, untimed (its tokenizer and model config: the same for every input); `open` is the input
opened again on its own (`forge.runtime.model.spec.open_input`: checks, the id scan, the count). The variants:

1. JSONL (`input.path`): the reference
2. `save_to_disk` folder (`input.dataset=DIR`), memory-mapped
3. the same folder, `input.streaming=true` (its Arrow files read a batch at a time)
4. the `json` builder over the renamed JSON file (`input.dataset=json input.data_files=[...]`;
   its Arrow cache is built in round 1, before it is timed, by an unmeasured warm-up)
5. the same builder, `input.streaming=true`

Rounds are interleaved (the harness). A child reports the seconds of each phase (`open`,
`fingerprint`, `records`) on its own clock; the table gives each variant's medians
and its ratio to JSONL (above 1: faster than JSONL) of the three phases together, in seconds
and in the child's CPU seconds (every thread's, `time.process_time`: less moved than seconds by
other jobs on a shared machine).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

ASSETS = Path(__file__).resolve().parents[2] / "functions" / "assets" / "statements.jsonl"
MAP = ["+input.columns.text=sentence", "+input.columns.id=uid", "+input.columns.prefix=shots"]


def variants(folder: Path) -> dict[str, list[str]]:
    json_builder = ["input.dataset=json", f"input.data_files=[{folder / 'renamed.jsonl'}]", *MAP]
    return {
        "JSONL": [f"input.path={folder / 'rows.jsonl'}"],
        "save_to_disk": [f"input.dataset={folder / 'disk'}", *MAP],
        "save_to_disk, streaming": [f"input.dataset={folder / 'disk'}", "input.streaming=true", *MAP],
        "json builder": json_builder,
        "json builder, streaming": [*json_builder, "input.streaming=true"],
    }


def write_inputs(folder: Path, rows: int) -> None:
    import datasets

    base = [json.loads(line) for line in ASSETS.read_text().splitlines()]
    out = [{**base[k % len(base)], "id": f"r{k:07d}"} for k in range(rows)]
    with open(folder / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in out)
    renamed = [{"uid": r["id"], "shots": r.get("prefix"), "sentence": r["text"], "label": r["label"]} for r in out]
    with open(folder / "renamed.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in renamed)
    datasets.Dataset.from_list(renamed).save_to_disk(str(folder / "disk"))


def child(overrides: list[str]) -> None:
    """One variant, in this process: the phases' seconds as the last line of JSON."""
    from forge.cli.build import build_spec
    from forge.cli.compose import compose
    from forge.runtime.model.spec import open_input

    function = build_spec(compose(["function=probe_gen", *overrides]), None).function  # the model's side: untimed
    clocks = [(time.perf_counter(), time.process_time())]
    function.input = open_input(function.cfg.input, function.columns)  # checked, ids scanned
    function.input.count()
    clocks.append((time.perf_counter(), time.process_time()))
    function.input.fingerprint()
    clocks.append((time.perf_counter(), time.process_time()))
    n = sum(1 for _ in function.records())
    clocks.append((time.perf_counter(), time.process_time()))
    got: dict[str, float] = {"records": n}
    for k, phase in enumerate(("open", "fingerprint", "records")):
        got[f"{phase}_s"] = clocks[k + 1][0] - clocks[k][0]
        got[f"{phase}_cpu_s"] = clocks[k + 1][1] - clocks[k][1]  # every thread's CPU time: less drift
    print(json.dumps(got))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    args = harness.parser(__doc__, rows=20000, rounds=3, only=None).parse_args(argv)
    harness.need("datasets", extra="datasets")
    report = harness.Report(args)
    with tempfile.TemporaryDirectory(prefix="forge-bench-datasets-") as tmp:
        folder = Path(tmp)
        write_inputs(folder, args.rows)
        env = harness.child_env(HF_DATASETS_CACHE=str(folder / "hf-cache"), OMP_NUM_THREADS="1")
        chosen = harness.pick(variants(folder), args.only)
        run = lambda overrides: harness.last_json(  # noqa: E731
            harness.timed([sys.executable, "-m", "benchmarks.scale.bench_datasets", "--child", *overrides], env).stdout
        )
        for overrides in chosen.values():
            run(overrides)  # warm-up: the tokenizer's files, the json builder's Arrow cache
        trials = harness.interleave(
            {name: (lambda r, o=overrides: _sample(run(o))) for name, o in chosen.items()}, args.rounds
        )
    _table(report, trials, args, chosen)
    report.trials(trials)
    report.save()


def _sample(got: dict) -> dict:
    phases = ("open", "fingerprint", "records")
    return {
        **got,
        "wall_s": sum(got[f"{p}_s"] for p in phases),
        "cpu_s": sum(got[f"{p}_cpu_s"] for p in phases),
    }


def _table(report: harness.Report, trials: harness.Trials, args, chosen: dict) -> None:
    base = "JSONL" if "JSONL" in chosen else None
    rows = []
    for name in trials.names:
        med = {k: trials.median(name, k) for k in ("open_s", "fingerprint_s", "records_s", "wall_s", "cpu_s")}
        ratios = [f"{trials.ratio(name, base, k):.2f}" if base else "-" for k in ("wall_s", "cpu_s")]
        rows.append([name, *(f"{med[k]:.2f}" for k in med), *ratios, trials.last(name)["records"]])
    report.text(f"{args.rows:,} rows, {args.rounds} rounds, medians; machine load {os.getloadavg()[0]:.1f} at the end")
    header = [
        "input",
        "open s",
        "fingerprint s",
        "records s",
        "total s",
        "total CPU s",
        "x JSONL (s)",
        "x JSONL (CPU s)",
    ]
    report.table([*header, "records"], rows)


if __name__ == "__main__":
    main()
