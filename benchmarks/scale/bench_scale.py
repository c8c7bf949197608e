"""The whole scheduler and run loop at scale, in virtual time: ten million items over eight simulated cards.

    python -m benchmarks scale [--rows 10000000] [--modes "token rows,token packed"] [--variants loop,scheduler]
                               [--window 65536] [--rounds 1]

N items (`--rows`, default 10,000,000) stream as numpy column chunks (`forge.core.columns.ColumnFeed`; the
reference workload's distribution, 50 prefixes, a fresh seed per chunk) through the real
`Scheduler` and `RunLoop` with the simulated executor (`SimExecutor`), over eight cards of
mixed memory (`conf/devices/mix8.yaml` when present), as `forge plan` drives them; the
ledger plugin counts every item and token through the hooks and must balance. No Python
object is made per item and no model runs. Beside it, as a reference, the `scheduler`
variant asks the same scheduler for batches directly (no loop, executor or hooks), so the
ratio of the two is the loop's own cost.

Each configuration runs in its own subprocess, so its peak RSS (`ru_maxrss`) is its own;
configurations are interleaved over rounds (the harness). Reported per run: items/s over the whole loop
(generating the columns included, and without it), items per CPU-second (this process's
user + system time: the figure to read on a shared machine), peak RSS, batches, and the
spread of the devices' virtual finish times.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from benchmarks import harness

MODES = {"token rows": {"packing": "rows"}, "token packed": {"packing": "packed"}}
MIX8 = harness.ROOT / "conf" / "devices" / "mix8.yaml"


def devices():
    """Eight cards: `conf/devices/mix8.yaml` when present, else the same mix declared here: two
    each of 16, 24, 32 and 80 GB, one set of limits (65,536 tokens, 512 rows, 4,096 long)."""
    from forge.vocab.geometry import Device, Limits

    if MIX8.exists():
        from omegaconf import OmegaConf

        from forge.config.devices import resolve_devices

        return resolve_devices(OmegaConf.to_container(OmegaConf.load(MIX8), resolve=True)), str(MIX8.name)
    limits = Limits(65536, 512, 4096, 8)
    out = [Device(f"card{gb}{k}", limits, memory_bytes=gb << 30) for gb in (16, 24, 32, 80) for k in "ab"]
    return out, "16/24/32/80 GB x 2, declared in bench_scale.py"


def chunks(n: int, chunk: int, seconds: list[float]):
    """(num_tokens, prefix code) column chunks of the reference distribution; generation time
    is added to `seconds[0]`."""
    from benchmarks.workloads import geometry

    for k, start in enumerate(range(0, n, chunk)):
        t0 = time.perf_counter()
        which, prefix_lens, suffix = geometry(min(chunk, n - start), 50, seed=1000 + k)
        out = prefix_lens[which] + suffix, which
        seconds[0] += time.perf_counter() - t0
        yield out


def run_one(mode: str, n: int, window: int, chunk: int, variant: str = "loop") -> dict:
    """One configuration, in this process: drive the loop to the end and measure it. With
    `variant="scheduler"`, the reference: the same scheduler asked for batches directly (the
    device that would be free first asks), no run loop, executor or hooks."""
    from benchmarks.workloads import geometry
    from forge.batching import TokenPacker
    from forge.builtin import ledger
    from forge.config.modes import TokenBatching
    from forge.config.schema import Runtime
    from forge.core.columns import ColumnFeed
    from forge.core.loop import Committer, RunLoop
    from forge.core.scheduler import Scheduler
    from forge.executors import SimExecutor
    from forge.pluginmanager import make_plugin_manager
    from forge.vocab.records import RunContext

    devs, source = devices()
    pm = make_plugin_manager(load_entry_points=False, modules=("forge.builtin.ledger",))
    run = RunContext(function="bench_scale", batching="token", devices=devs, run_dir=None, dry_run=True)
    pm.hook.forge_run_start(run=run)
    _, prefix_lens, _ = geometry(1, 50)
    gen_s = [0.0]
    received = (lambda items: pm.hook.forge_items_received(run=run, items=items)) if variant == "loop" else None
    feed = ColumnFeed(chunks(n, chunk, gen_s), prefix_lens, capacity=window, received=received)
    packer = TokenPacker(TokenBatching(**MODES[mode]))
    scheduler = Scheduler(packer, feed, devs, window=window, cache_tokens=1 << 20)
    if variant == "scheduler":
        return _scheduler_only(scheduler, packer, devs, n, gen_s, mode, window, source)
    executor = SimExecutor(packer.overhead_tokens)
    executor.start(devs)
    loop = RunLoop(scheduler, executor, Committer(None, set(), float("inf")), run=run, hook=pm.hook, policy=Runtime())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, cpu0 = time.perf_counter(), time.process_time()
    loop.run_until_done()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    led = ledger.ledger_of(run)
    clocks = list(executor.clocks.values())
    return {
        **_figures(mode, n, window, source, wall, cpu, gen_s[0], rss_before),
        "scheduler_s": loop.scheduler_s,
        "batches": sum(t.batches for t in loop.tallies.values()),
        "items": dict(led.items),
        "balanced": not led.check(),
        "imbalance": led.check(),
        "finish_spread": (max(clocks) - min(clocks)) / max(clocks),
        "max_window_items": scheduler.max_window_seen,
    }


def _figures(mode, n, window, source, wall, cpu, gen_s, rss_before) -> dict:
    """What both ways of timing report alike: the run's shape, its rates and its memory."""
    return {
        "mode": mode,
        "n": n,
        "window": window,
        "devices": source,
        "wall_s": wall,
        "gen_s": gen_s,
        "items_per_s": n / wall,
        "items_per_s_without_gen": n / (wall - gen_s),
        "cpu_s": cpu,
        "items_per_cpu_s": n / cpu,
        "rss_before_mib": rss_before / 1024,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _scheduler_only(scheduler, packer, devs, n, gen_s, mode, window, source) -> dict:
    clocks = {d.name: 0 for d in devs}
    batches = items = 0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, cpu0 = time.perf_counter(), time.process_time()
    while not scheduler.done:
        d = min(devs, key=lambda d: clocks[d.name])
        b = scheduler.schedule(d)
        clocks[d.name] += b.padded_slots + packer.overhead_tokens(d)
        batches += 1
        items += len(b.items)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        **_figures(mode, n, window, source, wall, cpu, gen_s[0], rss_before),
        "scheduler_s": wall,
        "batches": batches,
        "items": {"received": n, "completed": items},
        "balanced": items == n,
        "imbalance": [] if items == n else [f"{items} of {n} items scheduled"],
        "finish_spread": (max(clocks.values()) - min(clocks.values())) / max(clocks.values()),
        "max_window_items": scheduler.max_window_seen,
    }


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=1, rows=10_000_000)
    ap.add_argument("--window", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=262144)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--variants",
        default="loop,scheduler",
        help="loop: the run loop with the simulator and the ledger; scheduler: the scheduler alone",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: run this configuration, print JSON
    args = ap.parse_args(argv)
    if args.one:
        mode, variant = args.one.split("/")
        print(json.dumps(run_one(mode, args.rows, args.window, args.chunk, variant)))
        return
    modes = [f"{m}/{v}" for m in args.modes.split(",") for v in args.variants.split(",")]
    child = [sys.executable, "-m", "benchmarks.scale.bench_scale", "--rows", str(args.rows)]
    child += ["--window", str(args.window), "--chunk", str(args.chunk), "--one"]

    def config(m: str):
        return lambda r: harness.last_json(harness.timed([*child, m]).stdout)  # its wall_s: the loop's own

    trials = harness.interleave({m: config(m) for m in modes}, args.rounds)
    report(args, trials)


def report(args, trials: harness.Trials) -> None:
    rep = harness.Report(args)
    first = trials.samples[trials.names[0]][0]
    rep.text(
        f"{args.rows:,} items, 50 prefixes, window {args.window:,}, eight devices ({first['devices']}), "
        f"{args.rounds} round(s), medians",
        "",
    )
    lines = []
    for m in trials.names:
        rs = trials.samples[m]
        med = lambda k, m=m: trials.median(m, k)  # noqa: E731
        lines.append(
            [
                m,
                f"{med('items_per_s'):,.0f}",
                f"{med('items_per_s_without_gen'):,.0f}",
                f"{med('items_per_cpu_s'):,.0f}",
            ]
            + [f"{med('wall_s'):.1f}", f"{max(r['peak_rss_mib'] for r in rs):.0f}", f"{med('rss_before_mib'):.0f}"]
            + [f"{rs[0]['batches']:,}", all(r["balanced"] for r in rs), f"{100 * med('finish_spread'):.2f}%"]
        )
    header = ["mode / variant", "items/s (wall)", "items/s without generating columns", "items per CPU-second"]
    header += ["wall s", "peak RSS MiB", "RSS before the loop MiB", "batches", "ledger balanced", "finish spread"]
    rep.table(header, lines)
    rep.trials(trials)
    rep.save()
    bad = [r for rs in trials.samples.values() for r in rs if not r["balanced"] or r["items"]["completed"] != args.rows]
    if bad:
        raise SystemExit(f"ledger does not balance: {bad[0]['imbalance']} {bad[0]['items']}")


if __name__ == "__main__":
    main()
