"""`forge`: run, plan and list. Thin: config goes through Hydra, work through forge.driver.engine."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from forge.cli import early
from forge.cli.compose import compose, group_options, plugins_listed, precheck
from forge.cli.early import STOPPED_STATUS, catch_stop_signals, start_workers, stop_workers, stopped_line
from forge.cli.server_cli import server_app
from forge.cli.summary import GIB, console, err, error_line, print_summary, status_line
from forge.errors import ForgeError
from forge.eval.cli import EVAL_SETTINGS, eval_command

if TYPE_CHECKING:
    from forge.driver.report import Report

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Forge: GPU batch functions scheduled, packed and accounted in tokens.",
)
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
app.add_typer(server_app, name="server")
app.command("eval", context_settings=EVAL_SETTINGS)(eval_command)  # forge.eval.cli: lm-eval's CLI, --model forge


def _fail(exc: Exception) -> None:
    error_line(exc)
    raise typer.Exit(2)


@app.command(context_settings=EXTRA)
def run(ctx: typer.Context) -> None:
    """Run a function. Takes Hydra overrides, e.g. `forge run function=probe_gen batching=token`.

    Hydra's flags work too: `-m` / `--multirun` sweeps (`forge run -m batching=item,token,memory`),
    `--config-dir DIR` (your own config groups, e.g. a devices inventory), `--cfg job` (print
    the config). `output_dir=PATH` sets the run directory (default: a fresh one under outputs/);
    an fsspec URL (s3://bucket/run, gs://..., memory://...) works too.
    """
    ran: list[str] = []  # the run directory of each job whose run returned (a stop after it is no start-up's)
    previous = catch_stop_signals()  # SIGTERM in start-up: as Ctrl-C ({} where the command's main did it)
    try:
        start_workers(ctx.args)  # a no-op when the entry point started them
        task = _hydra_task(ran)
        precheck(ctx.args)
        saved = sys.argv
        sys.argv = ["forge run", *ctx.args]
        try:  # Hydra's code; the task stops at once (`stops_at_once`); `plugins=[...]` registered as it composes
            with early.stops_wait(), plugins_listed(ctx.args):
                task()
        finally:
            sys.argv = saved
    except ForgeError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        if not ran:
            stop_workers()  # no worker yet: the fork server would go on importing for seconds
        _stopped(stopped_line() if not ran else stopped_line(f"after the run in {ran[-1]} returned", ran=True))
        raise typer.Exit(STOPPED_STATUS) from None
    finally:
        early.restore_signals(previous)


def _stopped(line: str) -> None:
    """A `forge.cli.early.stopped_line`, its first word in the colour every stop line has."""
    err.print(f"[bold red]interrupted[/]{escape(line.removeprefix('interrupted'))}", highlight=False, soft_wrap=True)


def _hydra_task(ran: list[str]):
    """The job `forge run` runs through Hydra (`hydra.main`): its run, report and exit status."""
    import hydra

    from forge.cli.build import conf_dir
    from forge.cli.searchpath import register

    register()

    @hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
    def task(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        composed = time.time()  # Hydra composed the config and set up its job (report.json: compose_s)
        try:
            job_dir = HydraConfig.get().runtime.output_dir
            with early.stops_at_once(), _run_dir_of_job(str(cfg.output_dir), job_dir) as (run_dir, files):
                report = _execute(cfg, run_dir, files, composed)
                ran.append(str(run_dir))
        except ForgeError as exc:
            error_line(exc)
            raise SystemExit(2) from None  # not an Exception: Hydra lets it through without a traceback
        print_summary(report)
        if report.get("status", "finished") != "finished":
            status_line(report)
            raise SystemExit(130 if report["status"] == "interrupted" else 2)

    return task


def _warm_up_workers(cfg) -> None:
    """The process executor's fork server starts importing torch while the function is set up."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "runtime.executor", default=None) != "process":
        return
    from forge.executors.process import warm_up

    target = OmegaConf.select(cfg, "function._target_", default=None)
    warm_up((target.rpartition(".")[0],) if isinstance(target, str) and "." in target else ())


#: whether this process was started as the `forge` command (not a test runner calling the app)
_COMMAND = Path(sys.argv[0]).name in ("forge", "app.py", "entry.py")


@contextmanager
def _run_dir_of_job(output_dir: str, hydra_output_dir: str):
    """(the job's run directory, the files of Hydra's .hydra/ to put in it). Hydra wrote them
    to a local staging folder of this process (conf/config.yaml, `forge.io.location.hydra_dir`);
    the run copies them into its directory once it owns it, and the folder is removed when
    the job ends."""
    import shutil

    from forge.io.location import run_dir_of

    try:
        files = {
            f".hydra/{path.name}": path.read_bytes()
            for path in sorted((Path(hydra_output_dir) / ".hydra").glob("*"))
            if path.is_file()
        }
        yield run_dir_of(output_dir, hydra_output_dir), files
    finally:
        shutil.rmtree(hydra_output_dir, ignore_errors=True)


def _execute(cfg, run_dir, files: dict[str, bytes], composed_at: float) -> Report:
    from dataclasses import replace

    from forge.cli.build import build_spec
    from forge.cli.wire import CLIENT_STARTED
    from forge.driver.engine import execute
    from forge.driver.report import process_started
    from forge.pluginmanager import make_plugin_manager

    _warm_up_workers(cfg)
    started = CLIENT_STARTED[0] if CLIENT_STARTED else process_started() if _COMMAND else None
    spec = replace(
        build_spec(cfg, run_dir),
        files=files,
        started_at=started,
        composed_at=composed_at,
        warm_start=bool(CLIENT_STARTED),
    )
    return execute(spec, make_plugin_manager(modules=spec.plugins))


@app.command(context_settings=EXTRA)
def plan(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Draw the batch geometry (item mode beside this mode) and each device's timeline to a PNG."
    ),
    config_dir: Path | None = typer.Option(None, "--config-dir", help="Extra config directory searched first."),
    compare: bool = typer.Option(False, "--compare", help="Plan every batching mode and print them side by side."),
) -> None:
    """Dry run: tokenize, pack and route; print the geometry. Loads no model weights."""
    from forge.cli.build import build_spec
    from forge.driver.plan import plan as make_plan
    from forge.pluginmanager import make_plugin_manager

    if compare:
        return _compare(ctx.args, config_dir, as_json)
    try:
        cfg = compose(ctx.args, config_dir)
        report = make_plan(build_spec(cfg, None), make_plugin_manager(), keep_batches=plot is not None)
        if plot is not None:
            from forge.cli.plot import plot_plans

            other = "token" if report["batching"] == "item" else "item"
            base = make_plan(
                build_spec(compose([*ctx.args, f"batching={other}"], config_dir), None),
                make_plugin_manager(),
                keep_batches=True,
            )
            pair = (base, report) if other == "item" else (report, base)
            plot_plans(pair, plot, timeline=report)
    except ForgeError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps(_without_config(report), default=str))
    else:
        print_summary(report)
        if plot is not None:
            console.print(f"plot: {plot}")
    if report.get("status", "finished") != "finished":
        status_line(report)
        raise typer.Exit(2)


def _without_config(report: Report) -> dict[str, Any]:
    """report.json's keys but the resolved config (long; the command line says it)."""
    return {k: v for k, v in report.as_dict().items() if k != "config"}


def _compare(overrides: list[str], config_dir: Path | None, as_json: bool) -> None:
    """One plan per batching mode with a config file, side by side."""
    from forge.cli.build import build_spec
    from forge.driver.plan import plan as make_plan
    from forge.pluginmanager import make_plugin_manager

    plans = {}
    try:
        for mode in group_options("batching", config_dir):
            spec = build_spec(compose([*overrides, f"batching={mode}"], config_dir), None)
            plans[mode] = make_plan(spec, make_plugin_manager())
    except ForgeError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps({mode: _without_config(p) for mode, p in plans.items()}, default=str))
        return
    table = Table(title="plans side by side")
    for col in ("mode", "batches", "padded slots", "padding waste", "cache hit rate", "cache misses", "balanced"):
        table.add_column(col)
    for mode, p in plans.items():
        hit = p["cache_hit_rate"]
        table.add_row(
            mode,
            f"{p['batches']:,}",
            f"{p['tokens']['padded_slots']:,}",
            f"{100 * p['padding_waste']:.2f}%",
            "-" if hit is None else f"{100 * hit:.2f}%",
            ", ".join(f"{d['name']}: {d['cache_misses']}" for d in p["devices"]),
            "yes" if p["balanced"] else "NO",
        )
    console.print(table)


@app.command(context_settings=EXTRA)
def calibrate(
    ctx: typer.Context,
    items: int = typer.Option(256, "--items", help="How many input items to time batches of."),
    config_dir: Path | None = typer.Option(None, "--config-dir", help="Extra config directory searched first."),
) -> None:
    """Measure each device's per-step overhead in token-equivalents (for batch_overhead_tokens)."""
    from itertools import islice

    from forge.cli.build import build_spec
    from forge.runtime.cost.calibrate import calibrate as measure
    from forge.vocab.geometry import Item

    try:
        spec = build_spec(compose(ctx.args, config_dir), None)
        sample = [r for r in islice(spec.function.records(), items) if isinstance(r, Item)]
        table = Table(title="per-step overhead")
        for col in ("device", "s per step", "us per slot", "ns per score", "batch_overhead_tokens"):
            table.add_column(col)
        blocks = []
        for device in spec.devices:
            worker = spec.function.open_worker(device, 0)
            try:
                c = measure(worker, device, sample)
            finally:
                worker.close()
            table.add_row(
                device.name,
                f"{c.seconds_per_step:.4f}",
                f"{1e6 * c.seconds_per_slot:.2f}",
                f"{1e9 * c.seconds_per_score:.3f}",
                str(c.overhead_tokens),
            )
            blocks.append((device, c))
    except ForgeError as exc:
        _fail(exc)
    console.print(table)
    console.print(
        "Put the number in the device's inventory entry (batch_overhead_tokens) "
        "or in batching.batch_overhead_tokens. A simulated device that runs like each one "
        "(an inventory entry for `forge plan`):"
    )
    for device, c in blocks:
        sim = ", ".join(f"{k}: {v:.3e}" for k, v in c.sim_block().items())  # YAML reads 1.000e-04 as a number
        mem = f", memory_gb: {device.memory_bytes / GIB:.3g}" if device.memory_bytes else ""
        console.print(f"  - {{name: sim-{device.name}{mem}, sim: {{{sim}}}}}", highlight=False, soft_wrap=True)


@app.command()
def probe(
    run_dir: Path = typer.Argument(..., help="A probe_gen run directory (activations and labels)."),
    out: Path | None = typer.Option(None, "--out", help="Where to write the JSON (default: RUN_DIR/probe.json)."),
    plot: Path | None = typer.Option(None, "--plot", help="Where to draw the PNG (default: RUN_DIR/probe.png)."),
    test_fraction: float = typer.Option(
        0.25, "--test-fraction", help="Share of items (by a hash of their id) held out."
    ),
    c: float = typer.Option(1.0, "--C", help="Inverse L2 strength of the logistic regression."),
) -> None:
    """Fit a linear probe per layer on a probe_gen run; accuracy with a 95% interval per layer."""
    from forge.functions.probe import probe_run, probe_table  # probe_gen's: lives with the function

    try:
        result = probe_run(run_dir, out, plot, test_fraction, c)
    except ForgeError as exc:
        _fail(exc)
    console.print(probe_table(result))
    console.print(f"wrote {out or run_dir / 'probe.json'} and {result['plot']}")


@app.command(name="ls", context_settings=EXTRA)
def ls(
    ctx: typer.Context,
    config_dir: Path | None = typer.Option(None, "--config-dir", help="Extra config directory searched first."),
) -> None:
    """List functions, batching modes and trackers (with the plugin providing each, and whether a
    config selects it) and the devices found."""
    from forge.cli.build import to_plain
    from forge.config.devices import resolve_devices
    from forge.pluginmanager import batching_modes, functions, make_plugin_manager, trackers

    try:
        with plugins_listed(ctx.args):  # a function a listed module offers composes without a YAML
            cfg = to_plain(compose(ctx.args, config_dir))
        devices = resolve_devices(cfg.get("devices") or {})
        pm = make_plugin_manager(modules=list(cfg.get("plugins") or ()))  # and its modes and trackers are listed
        listed = (("functions", "function", functions(pm)), ("batching modes", "batching", batching_modes(pm)))
        listed += (("trackers", "trackers", trackers(pm)),)
        configs = {group: set(group_options(group, config_dir)) for _, group, _ in listed}
    except ForgeError as exc:
        _fail(exc)
    for title, group, offered in listed:
        table = Table(title=title)
        for col in ({"function": "function", "batching": "mode"}.get(group, "tracker"), "plugin", "config"):
            table.add_column(col)
        for name in sorted(set(offered) | configs[group]):
            ref, plugin = offered.get(name, (None, None))
            where = "-" if ref is None else f"{plugin} ({_ref_name(ref)})"
            pick = f"trackers=\\[{name}]" if group == "trackers" else f"{group}={name}"  # \\[: not rich markup
            table.add_row(name, where, pick if name in configs[group] else "- (no config)")
        console.print(table)
    table = Table(title="devices")
    for col in ("name", "torch device", "max_batch_tokens", "max_rows", "max_seq_len", "pad_multiple", "memory"):
        table.add_column(col)
    for d in devices:
        lim = d.limits
        mem = f"{d.memory_bytes / (1 << 30):.2f} GiB" if d.memory_bytes else "-"
        if d.group:  # a device group: its members and their budgets
            mem = " + ".join(f"{(m.memory_bytes or 0) / (1 << 30):.2f}" for m in d.group) + " GiB"
        table.add_row(
            d.name,
            " + ".join(m.torch_device for m in d.group) or d.torch_device,
            *map(str, (lim.max_batch_tokens, lim.max_rows, lim.max_seq_len, lim.pad_multiple)),
            mem,
        )
    console.print(table)


def _ref_name(ref: object) -> str:
    """A registered class or import path, as text."""
    if isinstance(ref, str):
        return ref
    return f"{getattr(ref, '__module__', '?')}.{getattr(ref, '__qualname__', ref)}"


def main() -> None:  # pragma: no cover - console entry point
    """The `forge` command: the app, then `quick_exit` with its exit code. SIGTERM is caught from
    the start (a warm server's child, `python -m forge.cli.app` come here first, not through
    `forge.cli.entry`); one that comes as the command exits ends it at once, with the status a
    stop gets."""
    from forge.cli.exit import quick_exit

    catch_stop_signals()
    code: int | str | None = None
    try:
        app()
    except SystemExit as exc:  # typer always ends this way, with the command's exit code
        code = exc.code
    if code == STOPPED_STATUS and early.STOPPED_BY and not early.REPORTED:  # typer's silent 130 while it parsed
        stop_workers()
        _stopped(stopped_line())
    stop_workers()  # not left tearing itself down (torch loaded) for up to a second after the exit
    try:
        quick_exit(code)
    except KeyboardInterrupt:
        _stopped(stopped_line("as the command exited", ran=True))
        os._exit(STOPPED_STATUS)


if __name__ == "__main__":  # pragma: no cover
    main()
