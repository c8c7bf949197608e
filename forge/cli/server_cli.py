"""`forge server start|stop|status`: the warm server's commands (`forge.cli.server`)."""

from __future__ import annotations

import time

import typer

from forge.cli.server import DEFAULT_IDLE_MINUTES
from forge.cli.summary import console, err

server_app = typer.Typer(
    no_args_is_help=True,
    help="A warm process per environment that has imported torch and transformers: `forge run` "
    "and `forge plan` then start in a fraction of a second. Runs as before without one.",
)


def _age(started: float) -> str:
    s = max(0, int(time.time() - started))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@server_app.command()
def start(
    idle_minutes: float = typer.Option(
        DEFAULT_IDLE_MINUTES, "--idle-minutes", min=0.1, help="Stop after this long without a command."
    ),
) -> None:
    """Start this environment's server (once; a second start says where it runs) and wait until
    it has imported what a command needs."""
    from forge.cli.server_control import start as start_server

    began = time.monotonic()
    try:
        state, started = start_server(idle_s=idle_minutes * 60)
    except RuntimeError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if started:
        console.print(
            f"forge server {state['pid']} ready in {time.monotonic() - began:.1f} s: forge run and forge plan "
            f"in this environment start warm; it stops after {idle_minutes:g} min idle (forge server stop)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"forge server {state['pid']} already runs for this environment (up {_age(state['started'])})",
            soft_wrap=True,
        )


@server_app.command()
def stop(
    every: bool = typer.Option(False, "--all", help="Every server of this user, whatever its environment."),
) -> None:
    """Stop this environment's server after the commands it runs."""
    from forge.cli.server_control import stop as stop_server

    stopped = stop_server(every=every)
    if not stopped:
        console.print("no forge server runs" + ("" if every else " for this environment"))
    for state in stopped:
        console.print(f"stopped forge server {state['pid']} ({state['served']} commands served)")


@server_app.command()
def status() -> None:
    """This user's servers: pid, age, commands served and running, and whether each serves this
    environment (the same interpreter, packages, Forge source and environment variables)."""
    from forge.cli.server_control import status as servers

    found = servers()
    if not found:
        console.print("no forge server runs (forge server start)")
    for address, state, mine in found:
        which = "this environment" if mine else "another environment"
        console.print(
            f"forge server {state['pid']}: {which}, up {_age(state['started'])}, {state['served']} commands served, "
            f"{state['running']} running ({address})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
