"""Built-in executors: process (the default), inprocess and ray (imported only when used)."""

from forge.hookspecs import hookimpl


@hookimpl
def forge_executors():
    return {
        "process": "forge.executors.process:ProcessExecutor.from_runtime",
        "inprocess": "forge.executors.inprocess:InProcessExecutor.from_runtime",
        "ray": "forge.executors.ray:RayExecutor.from_runtime",
    }
