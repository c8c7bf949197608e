"""What a function's own code may use beside the bases, re-exported by `forge.api`: the checks its
config dataclass declares with (`positive`, `one_of`, ...), result readers, the generic sinks, the
input column kinds and a few model facts. Functions import them from `forge.api`, never from the
modules below (tests/test_import_map.py).
"""

from __future__ import annotations

from forge.config.checks import non_negative, one_of, positive, share
from forge.config.schema import MISSING
from forge.io.ids import short as short_id
from forge.io.results import load as load_results, read_info
from forge.io.rows import MayBeEmpty
from forge.io.sinks import ResultSink, RoutedSink
from forge.runtime.model.capabilities import capabilities
from forge.runtime.tokens.token_rule import PairEncoder


def text_config(config):
    """The text model's config of a (possibly multimodal) model config."""
    from forge.runtime.model.hf_compat import text_config as of

    return of(config)


__all__ = [
    "MISSING",
    "MayBeEmpty",
    "PairEncoder",
    "ResultSink",
    "RoutedSink",
    "capabilities",
    "load_results",
    "non_negative",
    "one_of",
    "positive",
    "read_info",
    "share",
    "short_id",
    "text_config",
]
