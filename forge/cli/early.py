"""What a cold `forge run` starts before anything else: its workers' fork server.

Model: on a cold start the first batch waits for the worker's imports of torch and
transformers (2.8-3.0 s on a 2-core Intel Xeon, 6.9-7.5 s on a slower CPU), not for the
command's own set-up. So the command starts the process executor's fork server
(`forge.executors.process.warm_up`) as soon as its arguments say
the run will use it, before the CLI itself is imported: the entry point (`forge.cli.entry`)
calls `start_workers` once no warm `forge server` took the command, and `forge.cli.app` calls
it again for a command run another way (a test's `CliRunner`); the second call is a no-op.
"""

from __future__ import annotations

#: what the worker needs besides torch and transformers, preloaded before the function is known
RUNTIME_MODULES = ("forge.api", "forge.runtime.causal_lm", "forge.runtime.views")


def start_workers(args: list[str]) -> bool:
    """Start the fork server when the overrides in `args` (a `forge run`'s, after `run`) leave the
    default executor (process) in place; True if it was started. A sweep, a config print or
    another executor skips it: `forge.cli.app` then decides once the config is composed."""
    for a in args:
        key, _, value = a.partition("=")
        if (
            a in ("-m", "--multirun", "--cfg", "-c", "--help")
            or (key, value) == ("runtime", "ray")
            or (key == "runtime.executor" and value != "process")
        ):
            return False
    from forge.executors.process import warm_up

    warm_up(RUNTIME_MODULES)
    return True
