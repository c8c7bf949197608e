"""What every benchmark shares: its options, the interleaved rounds, medians and ratios, tables, child processes.

The rule the harness keeps: a benchmark reports ratios of variants measured side by side, in
one run, in interleaved rounds (every variant once per round, the order reversed every other
round: A B C, C B A, ...). This machine's speed drifts, up to 2x within minutes, so seconds
from different runs, or from variants run one after the other, are not comparable; within a
round the drift hits every variant alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: the options several benchmarks take, defined once: (flag, type, help)
COMMON: dict[str, tuple[str, type, str]] = {
    "rounds": ("--rounds", int, "interleaved rounds: every variant once a round, in turn, reversed every other round"),
    "rows": ("--rows", int, "input rows (items) of the workload"),
    "seed": ("--seed", int, "the workload's seed"),
    "only": ("--only", str, "comma-separated variant numbers to run, 1-based as the variants are listed"),
    "threads": ("--threads", int, "torch threads"),
}


def add_common(ap: argparse.ArgumentParser, out: bool = True, **defaults: Any) -> argparse.ArgumentParser:
    """The common options named in `defaults` (each its default, or (default, help)), and `--out`
    (not on a parser whose subcommands take it)."""
    for key, value in defaults.items():
        flag, kind, text = COMMON[key]
        default, text = value if isinstance(value, tuple) else (value, text)
        ap.add_argument(
            flag, type=kind, default=default, help=text if default is None else f"{text} (default: {default})"
        )
    if not out:
        return ap
    ap.add_argument(
        "--out",
        default=None,
        help="also write the result to this file: .json for the tables and figures as data, else the markdown",
    )
    return ap


def parser(doc: str, out: bool = True, **defaults: Any) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help, the common options of `defaults`."""
    summary, _, rest = (doc or "").strip().partition("\n\n")
    ap = argparse.ArgumentParser(
        description=summary, epilog=rest or None, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return add_common(ap, out, **defaults)


def pick(variants: Mapping[str, Any], only: str | None) -> dict[str, Any]:
    """The variants `--only` names (1-based numbers, in the order listed), or all of them."""
    if not only:
        return dict(variants)
    keep = {int(x) - 1 for x in only.split(",") if x.strip()}
    bad = sorted(k + 1 for k in keep if not 0 <= k < len(variants))
    if bad:
        raise SystemExit(f"--only: no variant {bad} (there are {len(variants)})")
    return {name: v for k, (name, v) in enumerate(variants.items()) if k in keep}


def need(*modules: str, extra: str = "bench") -> None:
    """Stop in one line, naming the extra to install, when a peer this run needs is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"{prog()}: needs {', '.join(missing)}: pip install -e '.[{extra}]'")


def prog() -> str:
    return os.path.basename(sys.argv[0]) or "benchmark"


def note(text: str) -> None:
    """Progress, on stderr: stdout holds the result."""
    print(text, file=sys.stderr, flush=True)


# -- the interleaved rounds ---------------------------------------------------------------------


def order(names: Sequence[str], round_: int) -> list[str]:
    """Round 0 in order, round 1 reversed, ...: A B C, C B A, A B C."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


@dataclass
class Trials:
    """Every variant's samples, round by round: dicts of figures, `wall_s` always among them."""

    samples: dict[str, list[dict]]

    @property
    def names(self) -> list[str]:
        return list(self.samples)

    def values(self, name: str, key: str = "wall_s") -> list:
        return [s[key] for s in self.samples[name] if s.get(key) is not None]

    def median(self, name: str, key: str = "wall_s") -> float | None:
        values = self.values(name, key)
        return statistics.median(values) if values else None

    def medians(self, key: str = "wall_s") -> dict[str, float | None]:
        return {name: self.median(name, key) for name in self.samples}

    def last(self, name: str) -> dict:
        return self.samples[name][-1]

    def fastest(self, names: Iterable[str], key: str = "wall_s") -> str | None:
        """Of `names`, the one with the least median `key` (none when `names` is empty)."""
        names = [n for n in names if self.median(n, key) is not None]
        return min(names, key=lambda n: self.median(n, key)) if names else None

    def ratio(self, name: str, baseline: str, key: str = "wall_s", higher_is_better: bool = False) -> float:
        """How many times better `name` did than `baseline`, of medians: for times, the baseline's
        over the variant's (2.0: twice as fast); for rates (`higher_is_better`), the other way."""
        mine, base = self.median(name, key), self.median(baseline, key)
        return mine / base if higher_is_better else base / mine

    def ratios(self, baseline: str, key: str = "wall_s", higher_is_better: bool = False) -> dict[str, float]:
        return {name: self.ratio(name, baseline, key, higher_is_better) for name in self.samples}


def interleave(
    variants: Mapping[str, Callable[[int], Any]],
    rounds: int,
    before_round: Callable[[int], None] | None = None,
    label: str = "",
) -> Trials:
    """Run every variant once per round, in turn (`order`); `before_round(r)` first, each round.

    A variant is called with the round's number and returns its sample: seconds, a dict of
    figures (its `wall_s` or, without one, the harness's clock around the call), or None (the
    harness's clock)."""
    trials = Trials({name: [] for name in variants})
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for name in order(list(variants), r):
            t0 = time.perf_counter()
            got = variants[name](r)
            wall = time.perf_counter() - t0
            sample = dict(got) if isinstance(got, Mapping) else {"wall_s": wall if got is None else float(got)}
            sample.setdefault("wall_s", wall)
            trials.samples[name].append(sample)
            note(f"{label}round {r + 1}/{rounds}: {name}: {sample['wall_s']:.2f} s (load {os.getloadavg()[0]:.1f})")
    return trials


# -- child processes ----------------------------------------------------------------------------


@dataclass
class Child:
    """A finished child process, timed from its spawn to its exit."""

    wall_s: float
    returncode: int
    stdout: str
    stderr: str

    def tail(self, lines: int = 1) -> str:
        text = (self.stdout + self.stderr).strip().splitlines()
        return "\n".join(text[-lines:])


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on the path (children run `python -m benchmarks...`)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def timed(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    log: Path | None = None,
    check: bool = True,
) -> Child:
    """Run `cmd` to its end, timed from its spawn to its exit. With `log`, its stdout and stderr
    go there together (and come back as `stdout`); `check`: a failure stops the benchmark."""
    env = dict(env) if env is not None else child_env()
    t0 = time.perf_counter()
    if log is not None:
        with open(log, "w") as f:
            done = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        wall = time.perf_counter() - t0
        child = Child(wall, done.returncode, Path(log).read_text(), "")
    else:
        done = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd)
        wall = time.perf_counter() - t0
        child = Child(wall, done.returncode, done.stdout, done.stderr)
    if check and child.returncode:
        where = f"; see {log}" if log is not None else ""
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({child.returncode}){where}:\n{child.tail(30)}")
    return child


def last_json(text: str) -> Any:
    """The JSON a child printed as its last line."""
    return json.loads(text.strip().splitlines()[-1])


# -- results ------------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table of cells already formatted (anything else through str)."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars
    return item() if callable(item) else str(value)


class Report:
    """What a benchmark prints on stdout, kept for `--out`: text and tables, and figures as data."""

    def __init__(self, args: argparse.Namespace | None = None):
        self.args = {k: v for k, v in vars(args).items() if k != "out"} if args is not None else {}
        self.out = getattr(args, "out", None)
        self.parts: list[dict] = []
        self.data: dict[str, Any] = {}

    def text(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.parts.append({"text": line})

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> None:
        rows = [[str(c) for c in row] for row in rows]
        if title:
            self.text("", title, "")
        print(table(header, rows), flush=True)
        self.parts.append({"header": list(header), "rows": rows})

    def trials(self, trials: Trials, key: str = "trials") -> None:
        """Keep every sample of every variant, round by round, in the JSON result."""
        self.data[key] = trials.samples

    def markdown(self) -> str:
        return "\n".join(p["text"] if "text" in p else table(p["header"], p["rows"]) for p in self.parts) + "\n"

    def save(self) -> None:
        if not self.out:
            return
        out = Path(self.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".json":
            body = {"benchmark": prog(), "args": self.args, "parts": self.parts, "data": self.data}
            out.write_text(json.dumps(body, indent=1, default=_plain) + "\n")
        else:
            out.write_text(self.markdown())
        note(f"result written to {out}")
