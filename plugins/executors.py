"""Built-in executors: process (the default), inprocess and ray (imported only when used).

Each class is its own factory: `Executor(function, cache_tokens, runtime, plugins=..., hook=...)`.
"""

from forge.hookspecs import hookimpl


@hookimpl
def forge_executors():
    return {
        "process": "forge.executors.process:ProcessExecutor",
        "inprocess": "forge.executors.inprocess:InProcessExecutor",
        "ray": "forge.executors.ray:RayExecutor",
    }
