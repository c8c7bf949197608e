"""`probe_gen`'s throughput before and after the hook points (issue 36), and what capturing costs.

    python -m benchmarks capture --old /tmp/venv-old/bin/forge [--new .venv/bin/forge] [--rounds 5]
        [--rows N] [--only 1,2,3]

Each run is `forge run function=probe_gen batching=token devices=cpu output_dir=...` as a user
types it (the process executor, one CPU worker), on the embedded default (2,500 rows unless
`--rows`), with one of two installs: `--old` (a tree from before the hook points, e.g. commit
7ebd200 installed in a venv of its own) and `--new` (this tree). Either may be a `forge`
executable or the venv's `python` (its sibling `forge` is run). A developer's check of Forge
against itself at another commit, not a figure of Forge, so it lives in benchmarks/dev/. The
variants, paired:

1. old, defaults (`pooling=last`): the reference
2. new, defaults: against 1 (the runner installs no hook when no capture is asked for)
3. new, `capture=[mlp_out.2,attn_out.2]`: against 2
4. old, `pooling=none`: the reference for 5
5. new, `pooling=none`: against 4
6. new, `pooling=none capture=[mlp_out.2,attn_out.2]`: against 5

Rounds are interleaved (the harness: 1 2 ... 6, then 6 ... 1; this machine's speed drifts), so a
variant and the one it is read against run next to each other in every round. Every figure comes
from the run's `report.json`: tokens/s is completed tokens over the report's `wall_s` (the
report's `useful_tokens_per_s`: from the run's start, start-up and the model's load included),
and tokens per busy second is completed tokens over the worker's busy time (`devices[].busy_s`:
the batches alone, where a hook's cost lands); tokens per worker CPU-second counts the CPU
seconds the busiest process took after `phases.worker_ready_s` (the worker's batches, polled in
/proc; the whole run's CPU seconds, start-up included, are kept in `--out`'s JSON). A ratio is
the median of the per-round ratios (variant over its reference, measured in the same round),
with their min and max; the quiet pairs are those whose two runs were both busy for at most
`--quiet` times their variant's least busy time in the run (a shared machine's other jobs slow
a run 5-20x, and a pair caught by a burst says nothing of the code). Each tree has
a `FORGE_CACHE` of its own, filled by one unmeasured warm-up run, and a fresh `XDG_RUNTIME_DIR`
(no `forge server` answers); every run's output folder is removed once its report is read.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness

CAPTURE = "capture=[mlp_out.2,attn_out.2]"
BASE = ["function=probe_gen", "batching=token", "devices=cpu"]
#: name -> (tree, overrides, the variant it is read against or None)
VARIANTS: dict[str, tuple[str, list[str], str | None]] = {
    "old, defaults": ("old", [], None),
    "new, defaults": ("new", [], "old, defaults"),
    f"new, {CAPTURE}": ("new", [CAPTURE], "new, defaults"),
    "old, pooling=none": ("old", ["pooling=none"], None),
    "new, pooling=none": ("new", ["pooling=none"], "old, pooling=none"),
    f"new, pooling=none {CAPTURE}": ("new", ["pooling=none", CAPTURE], "new, pooling=none"),
}


def forge_command(path: str) -> str:
    """The `forge` executable: `path` itself, or the one beside a venv's python."""
    p = Path(path).expanduser()
    if p.name.startswith("python"):
        p = p.parent / "forge"
    if not p.is_file():
        raise SystemExit(f"no forge executable at {p}")
    return str(p.absolute())  # not resolved: a venv's python is a link, its forge script is not


class Tree:
    """One install: its `forge` command, a `FORGE_CACHE` and an `XDG_RUNTIME_DIR` of its own."""

    def __init__(self, name: str, forge: str, root: Path):
        self.name, self.forge, self.root = name, forge, root / name
        (self.root / "cache").mkdir(parents=True)
        (self.root / "xdg").mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env = {**env, "FORGE_CACHE": str(self.root / "cache"), "XDG_RUNTIME_DIR": str(self.root / "xdg")}
        self.runs = 0
        self.count_cpu = False  # set once this process is its runs' subreaper
        python = Path(self.forge).read_text().splitlines()[0].removeprefix("#!").strip()
        where = "import forge, pathlib; print(pathlib.Path(forge.__file__).parent.parent)"
        done = harness.timed([python, "-c", where], env=self.env, cwd=self.root)
        self.source = done.stdout.strip()  # the tree this forge imports, printed with the result

    def run(self, overrides: list[str]) -> dict:
        """One `forge run`, timed from its start to its exit: its report's figures, the CPU seconds
        of its whole process tree (once all of it is reaped: `subreaper`), and those its busiest
        process once the worker was ready took (`Watch`: from `phases.worker_ready_s` after the
        process's start, which the report takes from /proc, to the end: the worker's batches)."""
        self.runs += 1
        out, log = self.root / f"run-{self.runs}", self.root / "last.log"
        cmd = [self.forge, "run", *BASE, *overrides, f"output_dir={out}"]
        try:
            cpu0 = cpu_children()
            with open(log, "w") as f:
                t0, spawned = time.perf_counter(), time.time()
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.root)
                watch = Watch(proc.pid)
                rc, wall = proc.wait(), time.perf_counter() - t0
            cpu = cpu_children() - cpu0 if reap() and self.count_cpu else None
            if rc:
                raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{log.read_text()[-3000:]}")
            report = json.loads((out / "report.json").read_text())
            ready = spawned + (report["phases"].get("worker_ready_s") or 0.0)
            return figures(report, wall, cpu, watch.done(since=ready))
        finally:
            shutil.rmtree(out, ignore_errors=True)


class Watch(threading.Thread):
    """A command's processes, polled in /proc (Linux): each one's CPU seconds over time. The
    process tree is scanned every `scan_s`, the processes found every `poll_s` (so a process's
    last `poll_s` is missed: 0.02 s, against the worker's seconds)."""

    def __init__(self, pid: int, poll_s: float = 0.02, scan_s: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.poll_s, self.scan_s = pid, poll_s, scan_s
        self.cpu: dict[int, list[tuple[float, float]]] = {}  # pid -> (time.time(), CPU seconds), ...
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.stopped = threading.Event()
        self.start()

    def run(self) -> None:
        known, scanned = {self.root}, 0.0
        while not self.stopped.is_set():
            if time.monotonic() - scanned > self.scan_s:
                known |= descendants(self.root, known)
                scanned = time.monotonic()
            for pid in list(known):
                fields = stat(pid)
                if fields is None:
                    known.discard(pid)
                else:
                    used = (int(fields[11]) + int(fields[12])) / self.tick
                    self.cpu.setdefault(pid, []).append((time.time(), used))
            time.sleep(self.poll_s)

    def done(self, since: float) -> float | None:
        """The most CPU seconds one process took after `since` (a time.time()); None where /proc
        could not be read."""
        self.stopped.set()
        self.join()
        took = [series[-1][1] - max((c for t, c in series if t <= since), default=0.0) for series in self.cpu.values()]
        return max(took, default=None) or None


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state, ppid, ..., utime at 11, stime at 12)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(root: int, known: set[int]) -> set[int]:
    """Every process under `root` or under one already `known` (orphans move to the subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        fields = stat(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [root, *known]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux): a run's fork server and worker,
    orphaned when its command exits, are reparented here, so that once reaped their CPU time
    counts in RUSAGE_CHILDREN (else it is lost with them)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap(wait_s: float = 30.0) -> bool:
    """Reap every descendant a run left (see `subreaper`); False if some outlive `wait_s`."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            time.sleep(0.05)
    harness.note(f"a run left processes running for {wait_s:.0f} s: its CPU time is not counted")
    return False


def cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def figures(report: dict, process_s: float, cpu_s: float | None, worker_s: float | None) -> dict:
    """What one run's report says: items and tokens completed, its wall and busy seconds, rates;
    tokens per CPU-second of the whole run (start-up included) and of the worker once ready."""
    tokens, items = report["tokens"]["completed"], report["items"]["completed"]
    busy = sum(d["busy_s"] for d in report["devices"])
    return {
        "wall_s": process_s,
        "report_wall_s": report["wall_s"],
        "busy_s": busy,
        "items": items,
        "tokens": tokens,
        "tok_s": tokens / report["wall_s"],
        "items_s": items / report["wall_s"],
        "busy_tok_s": tokens / busy,
        "cpu_s": cpu_s,
        "cpu_tok_s": tokens / cpu_s if cpu_s else None,
        "worker_cpu_s": worker_s,
        "worker_tok_s": tokens / worker_s if worker_s else None,
        "batches": report["batches"],
        "load": os.getloadavg()[0],
    }


def pair_ratios(trials: harness.Trials, name: str, base: str, key: str, quiet: float = 0.0) -> list[float]:
    """`name`'s figure over `base`'s, round by round (both ran in every round). With `quiet`, only
    the pairs whose two runs were both quiet: busy for at most `quiet` times their variant's
    least busy time of the run (on a shared machine, other jobs' bursts slow a run 5-20x)."""
    least = {n: min(s["busy_s"] for s in trials.samples[n]) for n in (name, base)}
    pairs = zip(trials.samples[name], trials.samples[base], strict=True)
    if quiet:
        pairs = (p for p in pairs if all(s["busy_s"] <= quiet * least[n] for s, n in zip(p, (name, base))))
    return [a[key] / b[key] for a, b in pairs if a.get(key) and b.get(key)]


def spread(ratios: list[float], count: bool = False) -> str:
    if not ratios:
        return "-"
    n = f", {len(ratios)} pairs" if count else ""
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}{n})"


#: the rates in the table: (report key, column)
RATES = (("tok_s", "tok/s"), ("busy_tok_s", "tok per busy s"), ("worker_tok_s", "tok per worker CPU-s once ready"))


def machine() -> str:
    """The CPU, its cores, torch and the load: the line printed above the table."""
    model = platform.processor() or "?"
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    import torch

    return f"{model}, {os.cpu_count()} cores; torch {torch.__version__}; load {os.getloadavg()[0]:.1f}"


def check_same_work(trials: harness.Trials) -> None:
    """Old and new complete the same items and tokens (else the rates are not comparable)."""
    for name, (_, _, base) in VARIANTS.items():
        if base is None or name not in trials.samples or base not in trials.samples:
            continue
        mine, theirs = trials.last(name), trials.last(base)
        if (mine["items"], mine["tokens"]) != (theirs["items"], theirs["tokens"]):
            raise SystemExit(f"{name} and {base} completed different work: {mine} vs {theirs}")


def result(args, trials: harness.Trials, before: str, trees: dict[str, Tree]) -> None:
    rep = harness.Report(args)
    rows = f"{args.rows:,} rows" if args.rows else "the embedded default, 2,500 rows"
    rep.text(f"machine: {before}; after the rounds: load {os.getloadavg()[0]:.1f}")
    rep.text("trees: " + "; ".join(f"{t.name}: {t.forge} imports forge from {t.source}" for t in trees.values()))
    rep.text(f"probe_gen, {rows}, {args.rounds} rounds interleaved; ratios: median of per-round pairs (min-max);")
    rep.text(f"quiet pairs: both runs busy at most {args.quiet}x their variant's least busy time in this run")
    lines = []
    for name in trials.names:
        base = VARIANTS[name][2]
        known = base in trials.samples
        row = [name, base if known else "-"]
        for key, _ in RATES:
            median = trials.median(name, key)
            row.append(f"{median:,.0f}" if median else "-")
            row.append(spread(pair_ratios(trials, name, base, key)) if known else "-")
        quiet = pair_ratios(trials, name, base, "busy_tok_s", args.quiet) if known else []
        lines.append([*row, spread(quiet, count=True), f"{trials.median(name):.2f}"])
    header = ["config", "against"] + [h for _, col in RATES for h in (f"median {col}", "ratio")]
    rep.table([*header, "ratio, tok per busy s, quiet pairs", "process s"], lines)
    rep.trials(trials)
    rep.save()


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=5, rows=(None, "input rows (default: the embedded 2,500)"), only=None)
    ap.add_argument("--old", required=True, help="the install before the change: its forge, or its venv's python")
    ap.add_argument("--new", default=sys.executable, help="the install after it (default: this python's forge)")
    ap.add_argument("--quiet", type=float, default=1.25, help="a quiet pair's bound (see the table; default: 1.25)")
    args = ap.parse_args(argv)
    todo = harness.pick(VARIANTS, args.only)
    limit = [f"input.limit={args.rows}"] if args.rows else []
    root = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    count_cpu = subreaper()
    if not count_cpu:
        harness.note("no subreaper here (not Linux?): no CPU-second figures")
    try:
        trees = {name: Tree(name, forge_command(getattr(args, name)), root) for name in ("old", "new")}
        for tree in trees.values():
            tree.count_cpu = count_cpu
        before = machine()
        for tree in trees.values():  # fills each tree's FORGE_CACHE (the embedded weights, class facts)
            harness.note(f"warm-up: {tree.name} ({tree.forge})")
            tree.run(["input.limit=50"])

        def variant(tree: str, overrides: list[str]):
            return lambda r: trees[tree].run([*overrides, *limit])

        trials = harness.interleave({n: variant(t, o) for n, (t, o, _) in todo.items()}, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    check_same_work(trials)
    result(args, trials, before, trees)


if __name__ == "__main__":
    main()
