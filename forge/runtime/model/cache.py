"""Loaded models kept across runs in one process: what `forge.Session` holds between its calls.

Model: a run's worker loads its model through `forge.runtime.model.spec.HFModel.load`. While a
`ModelCache` is active in this process (`keep_models`), a load whose source, loader, device,
attention and dtype match a model loaded before shares that model's weights instead of
reading them again. A worker may change the model it is given (the causal runner cuts the decoder to
the layers it reads, `forge.runtime.model.hf_compat.keep_first_layers`; transformers installs its
output-capturing hooks once, on the layers the model holds then), so the kept model is never
handed out: each worker gets a copy of its modules that shares its weights (`sharing_weights`).
Outside `keep_models` nothing is kept: a command's workers load their model as before. Device
groups (weights placed over several devices) are never kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: the caches active in this process, innermost last (a session's run pushes its own)
_ACTIVE: list[ModelCache] = []


class ModelCache:
    """Models by their load key, each kept as it was loaded and never handed out itself."""

    def __init__(self) -> None:
        self._models: dict[tuple, Any] = {}
        self.loads = 0  # weights read from their source (a kept model handed out again counts none)

    def get(self, key: tuple, load: Callable[[], Any]) -> Any:
        """A copy of the model under `key` that shares its weights; `load()` it the first time."""
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = load()
            self.loads += 1
        return sharing_weights(model)

    def __len__(self) -> int:
        return len(self._models)

    def clear(self) -> None:
        """Let every kept model go (its memory is freed once no worker holds it)."""
        self._models.clear()


def sharing_weights(model: Any) -> Any:
    """A copy of `model`'s modules, attributes and config whose parameters and buffers are the
    model's own tensors (no weight is copied): what a worker cuts, hooks or marks (transformers
    marks a model whose output-capturing hooks it installed, on the layers it held then) is the
    copy's, and the kept model stays as loaded."""
    import copy
    import itertools

    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def active() -> ModelCache | None:
    """The innermost cache active in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def keep_models(cache: ModelCache) -> Iterator[ModelCache]:
    """Loads in this process go through `cache` until the block ends."""
    _ACTIVE.append(cache)
    try:
        yield cache
    finally:
        _ACTIVE.remove(cache)
