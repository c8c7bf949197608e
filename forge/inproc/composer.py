"""A session's composed configs, kept: a call whose overrides differ from an earlier call's only in
the values a session fills in per call (`input.path`, `output_dir`) reuses that call's
composition instead of composing again (Hydra's compose is most of a warm call's start).

Model: the cache key is the call's overrides with those two values left out, the function
plugin handed in, and a fingerprint of the config files (the packaged `conf/` and the session's
`config_dir`: every YAML's path, size and modification time), so editing a YAML between two
calls composes again. A hit is a deep copy of the kept config with the call's two values set,
which is what composing with them gives: both are plain strings of the schema, read through
interpolation at access. An override of either key by the caller is never cached.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

PER_CALL = ("input.path", "output_dir")  # the keys a session sets per call


class Composer:
    """`compose(args)` with a session's cache of composed configs."""

    def __init__(self, compose: Callable[[list[str], Path | None], Any], config_dir: Path | None) -> None:
        self._compose = compose  # forge.cli.compose.compose: the command line's composition
        self._config_dir = config_dir
        self._kept: dict[tuple, Any] = {}

    def __call__(self, args: list[str], per_call: dict[str, str], plugin: object) -> Any:
        """The config of `args` (the call's own overrides) plus `per_call` (`key -> value`, the
        session's per-call settings among `PER_CALL`), as `compose` gives it."""
        from omegaconf import OmegaConf, open_dict

        if any(override_key(a) in PER_CALL for a in args):  # the caller sets one itself: compose as written
            return self._compose([*args, *spelled(per_call)], self._config_dir)
        key = (tuple(args), tuple(sorted(per_call)), id(plugin), self._fingerprint())
        kept = self._kept.get(key)
        if kept is None:
            cfg = self._compose([*args, *spelled(per_call)], self._config_dir)
            self._kept = {key: copy.deepcopy(cfg)}  # one kept: a session's calls mostly repeat the last
            return cfg
        cfg = copy.deepcopy(kept)
        with open_dict(cfg):
            for name, value in per_call.items():
                OmegaConf.update(cfg, name, value, merge=False)
        return cfg

    def _fingerprint(self) -> tuple:
        from forge.cli.build import conf_dir

        folders = [conf_dir(), *([self._config_dir] if self._config_dir is not None else [])]
        return tuple(
            (str(p), st.st_size, st.st_mtime_ns)
            for folder in folders
            for p in sorted(folder.rglob("*.yaml"))
            for st in [p.stat()]
        )


def override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def spelled(per_call: dict[str, str]) -> list[str]:
    return [f"{name}={_value(value)}" for name, value in per_call.items()]


def _value(text: str) -> str:
    """`text` as one value of Hydra's override grammar: as it is, or quoted."""
    import re

    if re.fullmatch(r"[\w./:@~+-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
