"""The id rule: one canonical text per row id, checked.

An integer and a string of the same text are the same id (`1` and `"1"` are "1"); a row
without one gets `#<row index>`, a form an explicit id may not take, so the two never collide;
any other type is a bad id. `short` renders any value in a message, bounded.
"""

from __future__ import annotations

import json
import re
from typing import Any

from forge.io.readers import Record

_AUTO_ID = re.compile(r"#[0-9]+")  # the ids of rows without one


def good_id(rec: Record) -> str | None:
    """The record's canonical id, or None where it has no usable one (unreadable, a bad id)."""
    if rec.data is None:
        return None
    rid, problem = canonical_id(rec.data.get("id"), rec.index)
    return rid if problem is None else None


def id_token(token: bytes, index: int) -> str | None:
    """The canonical id a JSON value token spells (a string or an integer), or None."""
    try:
        if not token.startswith(b'"'):
            value: Any = int(token)
        elif b"\\" in token:
            value = json.loads(token)
        else:
            value = token[1:-1].decode("utf-8")  # no escape: the bytes are the string
    except Exception:  # noqa: BLE001  (not what `rows` reads: that line fails there)
        return None
    rid, problem = canonical_id(value, index)
    return rid if problem is None else None


def canonical_id(value: Any, index: int) -> tuple[str, str | None]:
    """(the row's id as a string, None) or (_, the problem with it)."""
    if value is None:
        return f"#{index}", None
    if type(value) is str and value.isascii() and not value.startswith("#"):
        return value, None  # the common case
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return "", (
            f"'id' must be a string or an integer, got {type(value).__name__} {short(value)}; "
            "fix the id or leave it out"
        )
    if isinstance(value, int):
        return str(value), None
    if _AUTO_ID.fullmatch(value):
        return "", (
            f"'id' {short(value)} has the form '#<digits>', which is reserved for rows without an id; rename it"
        )
    bad = unencodable(value)
    if bad is not None:
        return "", (
            f"'id' holds an unpaired surrogate (\\u{ord(value[bad]):04x} at position {bad}); "
            "write the character whole or drop it"
        )
    return value, None


# -- helpers of messages and fields --------------------------------------------------------


def unencodable(text: str | None) -> int | None:
    """Position of the first character UTF-8 cannot encode (an unpaired surrogate, from a JSON
    escape like \\ud800): tokenizers refuse the whole batch it is in."""
    if not text or text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def short(value: Any, limit: int = 40) -> str:
    """A bounded repr of a row's value for a message; never raises (long strings and
    containers are cut before their repr is taken)."""
    try:
        if isinstance(value, str):
            text = repr(value[:limit])
        elif isinstance(value, (list, tuple, dict)) and len(value) > 8:
            return f"<{type(value).__name__} of {len(value)}>"
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
            return f"<int of {value.bit_length()} bits>"
        else:
            text = repr(value)
    except Exception:  # noqa: BLE001  (a deep or odd value: its type is enough)
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the format readers -------------------------------------------------------------------
