"""`forge.run` and `forge.Session`: a run composed exactly as `forge run` composes it, run in
the calling process, its results handed back (`forge.inproc.result.Result`).

Model: a call's overrides are the command line's own (`"layers=[1,3]"`, `"batching=memory"`).
They go through the command's composition and checks (`forge.cli.compose`: `compose`,
`check_devices`; `forge.io` for the run directory), the one place that reads the config
(`forge.cli.build.build_spec`) and the engine (`forge.driver.engine.execute`), so the defaults,
the validation and every one-line error (a `ForgeError`) are the command's. Rows handed in as
dicts are written to a JSONL file in the session's folder and read as `input.path`, as the
command would read them.

A session runs its batches in this process (`runtime.executor=inprocess` unless the overrides
pick another executor) and keeps every model its runs loaded (`forge.runtime.model.cache`), so
its second call reads no weights. It starts no process; closing it lets the models go and
removes its folder (the run directories of calls without `output_dir`). Ctrl-C during a call
stops the run as it stops `forge run` (batches in flight finish, the report is written), then
raises KeyboardInterrupt; the session stays usable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from forge.cli.compose import compose
from forge.errors import ForgeError
from forge.inproc.composer import Composer, override_key, spelled
from forge.inproc.functions import function_plugin
from forge.inproc.result import Result
from forge.io.ids import canonical_id
from forge.runtime.model.cache import ModelCache, keep_models


class Session:
    """Runs in this process that share their loaded models: `with forge.Session() as s: s.run(...)`."""

    def __init__(self, overrides: Sequence[str] = (), *, config_dir: str | os.PathLike | None = None) -> None:
        self.overrides = _overrides(overrides, "overrides")  # every call's, before its own
        self.config_dir = None if config_dir is None else Path(config_dir)
        self.models = ModelCache()  # what this session's runs loaded
        self._dir = tempfile.mkdtemp(prefix="forge-session-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._calls = 0
        self._composer = Composer(compose, self.config_dir)  # the call's config, kept for the next
        self._built: dict[tuple[str, ...], Any] = {}  # the last run's function, by its overrides (`function`)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._cleanup.alive

    def close(self) -> None:
        """Let the session's models go and remove its folder (run directories it made included)."""
        self.models.clear()
        self._built.clear()
        self._cleanup()

    def run(
        self,
        function: str | type,
        rows: Iterable[Mapping[str, Any]] | str | os.PathLike | None = None,
        *,
        overrides: Sequence[str] = (),
        output_dir: str | os.PathLike | None = None,
    ) -> Result:
        """Run `function` (a registered function's name, or a function class) over `rows` (dicts,
        or a JSONL or Parquet path; None: the function's configured input) with `overrides`, in
        this process; the run directory is `output_dir`, else a folder of the session's."""
        if self.closed:
            raise ForgeError("this forge.Session is closed; open a new one")
        started = time.time()
        name, plugin = function_plugin(function)
        self._calls += 1
        call = self._calls
        args = self._args(name, overrides)
        if rows is not None:
            other = next((a for a in args if override_key(a) in ("input.path", "input.dataset")), None)
            if other is not None and other.partition("=")[2] not in ("", "null"):
                raise ForgeError(f"rows and {other} both give the run's input; pass the rows, or the override alone")
        out = str(output_dir) if output_dir is not None else f"{self._dir}/run-{call}"
        repeats_ok = any(override_key(a) == "input.duplicate_ids" and not a.endswith("=error") for a in args)
        given = {} if rows is None else {"input.path": self._input(rows, call, repeats_ok)}
        per_call = {"output_dir": out} | given
        words = rows_words(given.get("input.path"))
        try:
            return _execute(args, per_call, self._composer, out, started, self.models, plugin, words, self._built)
        except ForgeError as exc:
            if not given:
                raise
            said = ForgeError(words(str(exc)))  # the rows handed in, not the session's file of them
            said.result = getattr(exc, "result", None)
            raise said from None

    def function(self, function: str | type, *, overrides: Sequence[str] = ()):
        """The function instance a `run` with these overrides builds (its tokenizer, its settings),
        without running it: the last run's own when it had these overrides, else built from a
        config composed as the command line composes it (the function's configured input)."""
        from forge.cli.build import build_function, to_plain
        from forge.pluginmanager import extra_plugins

        if self.closed:
            raise ForgeError("this forge.Session is closed; open a new one")
        name, plugin = function_plugin(function)
        args = self._args(name, overrides)
        if tuple(args) in self._built:
            return self._built[tuple(args)]
        with extra_plugins(*([plugin] if plugin is not None else [])):
            cfg = self._composer(args, {"output_dir": f"{self._dir}/unrun"}, plugin)
            return build_function(to_plain(cfg))

    def _args(self, name: str, overrides: Sequence[str]) -> list[str]:
        """A call's overrides: the session's, the function, the call's own; the models stay in this
        process (the in-process executor) unless they pick another executor."""
        args = [*self.overrides, f"function={name}", *_overrides(overrides, "overrides")]
        if not any(override_key(a) in ("runtime", "runtime.executor") for a in args):
            args.insert(0, "runtime.executor=inprocess")
        return args

    def _input(self, rows: Any, call: int, repeats_ok: bool = False) -> str:
        if isinstance(rows, (str, os.PathLike)):
            return str(rows)
        if isinstance(rows, Mapping) or not isinstance(rows, Iterable):
            raise ForgeError(f"rows: a {type(rows).__name__}; pass a list of dicts (one per row) or a file's path")
        partial = Path(self._dir) / f"rows-{call}.partial"
        digest = hashlib.sha256()
        seen: dict[str, int] = {}  # id -> the first row that had it (the id rule: forge.io.ids)
        with partial.open("w") as f:
            for n, row in enumerate(rows):
                if not isinstance(row, Mapping):
                    raise ForgeError(f"rows[{n}]: a {type(row).__name__}; every row is a dict, e.g. {{'text': ...}}")
                try:
                    line = json.dumps(dict(row), default=_plain) + "\n"
                except (TypeError, ValueError) as exc:
                    raise ForgeError(f"rows[{n}]: not JSON ({exc}); give plain values (text, numbers, lists)") from None
                rid, problem = canonical_id(row.get("id"), n)
                if problem is None and not repeats_ok and seen.setdefault(rid, n) != n:
                    raise ForgeError(
                        f"rows[{seen[rid]}] and rows[{n}] have the same id {rid!r}; give each row its own id, "
                        "or keep one with the override input.duplicate_ids=first (or last)"
                    )
                f.write(line)
                digest.update(line.encode())
        # named by its content: the same rows are the same input.path, so a run stopped by Ctrl-C resumes
        return str(partial.replace(partial.with_name(f"rows-{digest.hexdigest()[:16]}.jsonl")))


def run(
    function: str | type,
    rows: Iterable[Mapping[str, Any]] | str | os.PathLike | None = None,
    *,
    overrides: Sequence[str] = (),
    output_dir: str | os.PathLike | None = None,
) -> Result:
    """One run in this process, in a session of its own (closed before this returns: its models
    go, and without `output_dir` its run directory too; the Result holds what was read)."""
    with Session() as session:
        result = session.run(function, rows, overrides=overrides, output_dir=output_dir)
        if output_dir is None:
            result.read_folders()  # its run directory goes with the session
        return result


def rows_words(path: str | None) -> Callable[[str], str]:
    """What a run says of its input, as the caller of `forge.run` knows it: rows handed in are
    `rows[i]`, not lines of the session's file of them (identity where the input is a path)."""
    if path is None:
        return lambda text: text

    def words(text: str) -> str:
        text = text.replace(f"input.path={path}", "rows").replace(path, "rows")
        return re.sub(r"\bline (\d+)\b", lambda m: f"rows[{int(m.group(1)) - 1}]", text)

    return words


def _execute(
    args: list[str],
    per_call: dict[str, str],
    composer: Composer,
    out: str,
    started: float,
    models: ModelCache,
    plugin,
    words: Callable[[str], str],
    built: dict[tuple[str, ...], Any],
) -> Result:
    from omegaconf import OmegaConf

    from forge.cli.build import build_spec
    from forge.cli.compose import check_devices
    from forge.driver.engine import execute
    from forge.io.location import check_output_dir, local_path
    from forge.io.store import check_run_dir
    from forge.pluginmanager import extra_plugins, make_plugin_manager

    with extra_plugins(*([plugin] if plugin is not None else [])), keep_models(models):
        cfg = composer(args, per_call, plugin)
        composed = time.time()
        run_dir = local_path(out) or out
        spec = build_spec(cfg, run_dir)  # the config validated (`to_plain`) as `forge run` validates it
        check_devices(spec.config)
        check_output_dir(out)
        check_run_dir(out, bool(spec.config.get("resume")))
        files = {
            ".hydra/config.yaml": OmegaConf.to_yaml(cfg).encode(),
            ".hydra/overrides.yaml": "".join(f"- {json.dumps(a)}\n" for a in [*args, *spelled(per_call)]).encode(),
        }
        spec = replace(spec, files=files, started_at=started, composed_at=composed)
        built.clear()
        built[tuple(args)] = spec.function
        with _cpu_threads(spec):
            report = execute(spec, make_plugin_manager(modules=spec.plugins)).as_dict()
    status = report.get("status", "finished")
    if status == "interrupted":
        raise KeyboardInterrupt(report.get("error") or "interrupted")
    folder = getattr(spec.function, "folder", None)
    if status != "finished":
        error = str(report.get("error") or "")
        said = error if error.startswith(f"{status}:") else f"{status}: {error}"
        stopped = ForgeError(f"{said} (run directory {out})")
        with contextlib.suppress(Exception):  # what it committed (the good rows of an input that stopped it),
            stopped.result = Result.read(str(run_dir), report, folder, words)  # where it can be read: never masks why
            stopped.result.read_folders()  # a directory of the session's may go before the caller reads it
        raise stopped
    return Result.read(str(run_dir), report, folder, words)


@contextmanager
def _cpu_threads(spec) -> Iterator[None]:
    """In this process, a CPU device runs with the torch threads the process executor's worker
    would take (the machine's CPUs over its CPU devices), so a call's numbers are the command's
    to the bit (a float sum's order follows the thread count); this process's own setting is
    put back after."""
    cpus = sum(d.torch_device == "cpu" for d in spec.devices)
    if spec.runtime.executor != "inprocess" or not cpus:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cpus))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _overrides(overrides: Sequence[str], what: str) -> list[str]:
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ForgeError(f'{what}: a list of the command line\'s overrides, e.g. ["layers=[1,3]", "batching=memory"]')
    return list(overrides)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as JSON's own values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")
