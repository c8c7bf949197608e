"""What Forge reads from a model's class rather than its config, kept on disk between runs.

Model: the capability checks (`forge.runtime.model.capabilities`, `forge.runtime.forward.encoder`) need
three facts about the class an `Auto*` loader would pick for a config: its name (or that
there is none), which attention implementations it supports, and whether its base model's
forward takes one mask per layer type. Reading them imports the modeling code, about 0.8 s
of `transformers.modeling_utils` on a CPU core, which `forge run`'s own process otherwise
never needs (its workers import it, in a fork server started first). So `class_facts` keeps
what it read in `$FORGE_CACHE/class_facts.json`, keyed by the transformers version, the
loader and the config class: a later run reads them without importing any modeling code.
Only transformers' own classes are kept; a model's own code (`trust_remote_code`) and a
class passed in are always read afresh. A cache that cannot be read or written is ignored.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: bumped when what the facts mean, or how they are read, changes (old entries are then ignored)
FACTS_VERSION = 1
#: the class attribute that says an attention implementation is supported
SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


@dataclass(frozen=True)
class ClassFacts:
    """The facts about one model class that decide what Forge can run exactly."""

    name: str | None  # e.g. "LlamaForCausalLM"; None: transformers has no such class for the config
    module: str | None  # where the class lives (a worker's fork server preloads it)
    supports: tuple[str, ...]  # attention implementations the class declares support for
    mask_mapping: bool  # its base model's forward takes {layer type: mask} (transformers 5 hybrids)

    def supports_attn(self, impl: str) -> bool:
        return impl not in SUPPORT_FLAGS or impl in self.supports


NO_CLASS = ClassFacts(None, None, (), False)


def facts_of(cls: type | None) -> ClassFacts:
    """Read the facts from a class (imported already)."""
    if cls is None:
        return NO_CLASS
    supported = tuple(impl for impl, flag in SUPPORT_FLAGS.items() if getattr(cls, flag, False))
    return ClassFacts(cls.__name__, cls.__module__, supported, _takes_mask_mapping(cls))


def class_facts(config: Any, loader: str) -> ClassFacts:
    """The facts about the class `transformers.<loader>` (AutoModelForCausalLM, AutoModel)
    loads for `config`, from the cache when it holds them, else read and kept."""
    key = _key(config, loader)
    if key is None:
        return facts_of(_resolve(config, loader))
    path = cache_path()
    kept = _read(path)
    if key in kept:
        entry = kept[key]
        return ClassFacts(entry["name"], entry["module"], tuple(entry["supports"]), bool(entry["mask_mapping"]))
    facts = facts_of(_resolve(config, loader))
    _write(path, {**kept, key: asdict(facts)})
    return facts


def class_fact(config: Any, loader: str, name: str, read: Callable[[], Any]) -> Any:
    """One more fact, a JSON value that `read()` finds (by building a model, say), about the class
    `loader` picks for `config`: kept beside the others under `name`, and read again only for
    another transformers version or config class (always for a model's own code)."""
    key = _key(config, loader)
    if key is None:
        return read()
    key, path = f"{key}|{name}", cache_path()
    kept = _read(path)
    if key in kept:
        return kept[key]
    value = read()
    _write(path, {**_read(path), key: value})
    return value


def cache_path() -> Path:
    from forge.runtime.model.embedded import default_cache_dir

    return default_cache_dir() / "class_facts.json"


def _resolve(config: Any, loader: str) -> type | None:
    import transformers

    mapping = getattr(transformers, loader)._model_mapping
    return mapping[type(config)] if type(config) in mapping else None


def _key(config: Any, loader: str) -> str | None:
    """The cache key, or None for a config class outside transformers (a model's own code)."""
    cls = type(config)
    if not cls.__module__.startswith("transformers.models.") or getattr(config, "auto_map", None):
        return None
    import transformers

    return f"v{FACTS_VERSION}|transformers {transformers.__version__}|{loader}|{cls.__module__}.{cls.__qualname__}"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    """Written whole to a temporary file, then renamed: a reader never sees half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _takes_mask_mapping(model_class: type) -> bool:
    """Whether the base model's forward accepts {layer type: mask} (transformers 5 hybrids)."""
    base = getattr(model_class, "base_model_prefix", "")
    for cls in (model_class, *_base_classes(model_class, base)):
        try:
            forward = cls.forward  # type: ignore[attr-defined]  # a model class: it has one
            if "causal_mask_mapping := attention_mask, dict" in inspect.getsource(forward):
                return True
        except (OSError, TypeError):
            pass
    return False


def _base_classes(model_class: type, prefix: str) -> list[type]:
    """The base model class (e.g. MistralModel next to MistralForCausalLM), found in its module."""
    module = sys.modules.get(model_class.__module__)
    stem = model_class.__name__
    for tail in ("ForCausalLM", "LMHeadModel"):
        stem = stem.removesuffix(tail)
    cls = getattr(module, f"{stem}Model", None) or getattr(module, f"{stem}TextModel", None)
    return [cls] if isinstance(cls, type) else []
