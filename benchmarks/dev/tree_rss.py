"""Peak resident memory of a command's process tree, per process and summed (sampled every 20 ms).

    python -m benchmarks.dev.tree_rss forge run function=generate input.path=rows.jsonl max_new_tokens=32

Prints the tree's peak (the sum `generate-cold` reports) and each process's own peak and its share
at the tree's peak, with its command line (a process forked from another shows its parent's until
it execs: the fork server's first sample reads as the driver's).
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.peers.gen_cold import rss, tree


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()[:150]
    except OSError:
        return "?"


def main(argv: list[str]) -> None:
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, at_peak, at_s = 0, {}, 0.0
    own: dict[int, int] = {}
    names: dict[int, str] = {}
    while proc.poll() is None:
        now = {p: rss(p) for p in tree(proc.pid)}
        total = sum(now.values())
        for p, r in now.items():
            names.setdefault(p, cmdline(p))
            own[p] = max(own.get(p, 0), r)
        if total > peak:
            peak, at_peak, at_s = total, now, time.time() - t0
        time.sleep(0.02)
    print(f"exit {proc.returncode}, {time.time() - t0:.1f} s; tree peak {peak / 2**20:,.0f} MiB at {at_s:.1f} s")
    for p, r in own.items():
        print(f"  pid {p}: peak {r / 2**20:,.0f} MiB, {at_peak.get(p, 0) / 2**20:,.0f} at the tree's peak: {names[p]}")


if __name__ == "__main__":
    main(sys.argv[1:])
