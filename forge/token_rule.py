"""The token rule: how a (prefix, text) pair becomes token ids, the same in every batching mode.

Model: an item's tokens are its prefix tokenized alone *with* the tokenizer's special tokens,
followed by its text tokenized alone *without* them; a text without a prefix is tokenized with
them. So a prefix is one fixed block of tokens, the same for every text after it: its key (a
hash of the prefix) groups the items that share it, and its KV can be run once and cached.

An EOS the tokenizer appends to every text is dropped from prefixes (it would sit between
prefix and text). A prefix ending in whitespace is warned about: BPE merges across the
boundary, so tokenizing apart can differ from tokenizing the joined string.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

RULE = "prefix with special tokens + text without; text alone with them (v1)"


class TokenRule:
    """Tokenizes prefixes (once each) and texts with one tokenizer; collects warnings."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.prefixes: dict[str, tuple[str, list[int]]] = {}  # prefix text -> (key, token ids)
        self.warnings: list[str] = []

    def _warn(self, note: str) -> None:
        if note not in self.warnings:
            self.warnings.append(note)

    def texts(self, texts: Sequence[str], with_special: bool) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tok(list(texts), add_special_tokens=with_special)["input_ids"]]

    def prefix(self, prefix: str) -> tuple[str, list[int]]:
        """(prefix key, token ids) of a prefix, tokenized once."""
        hit = self.prefixes.get(prefix)
        if hit is None:
            ids = self._strip_eos(prefix, list(self.tok(prefix, add_special_tokens=True)["input_ids"]))
            key = hashlib.sha1(prefix.encode()).hexdigest()[:12]
            hit = self.prefixes[prefix] = (key, ids)
            if prefix != prefix.rstrip(" \t\r\f\v"):
                self._warn(f"prefix {key} ends in whitespace: tokenizing it apart from the text can differ from "
                           "tokenizing the joined string (BPE merges across the boundary); end prefixes with a "
                           "newline or start texts with the space")
        return hit

    def _strip_eos(self, prefix: str, ids: list[int]) -> list[int]:
        eos = self.tok.eos_token_id
        if eos is None or not ids or ids[-1] != eos:
            return ids
        plain = self.tok(prefix, add_special_tokens=False)["input_ids"]
        if not plain or ids[-1 - len(plain):-1] != plain:
            return ids  # the EOS is the prefix's own text (or a BOS that doubles as EOS)
        self._warn("the tokenizer appends EOS to every text: Forge drops it from prefixes (it would sit "
                   "between prefix and text) and keeps it at the end of rows without a prefix")
        return ids[:-1]
