"""The token rule: how a (prefix, text) pair becomes token ids, the same in every batching mode.

Model: an item's tokens are its prefix tokenized alone *with* the tokenizer's special tokens,
followed by its text tokenized alone *without* them; a text without a prefix is tokenized with
them. So a prefix is one fixed block of tokens, the same for every text after it: its key (a
hash of the prefix) groups the items that share it, and its KV can be run once and cached.

An EOS the tokenizer appends to every text is dropped from prefixes (it would sit between
prefix and text). A prefix ending in whitespace is warned about: BPE merges across the
boundary, so tokenizing apart can differ from tokenizing the joined string.

`PairEncoder` is the other rule Forge ships: lm-evaluation-harness's (context, continuation)
encoding, for functions that score continuations as lm-eval does (`score`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

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
                self._warn(
                    f"prefix {key} ends in whitespace: tokenizing it apart from the text can differ from "
                    "tokenizing the joined string (BPE merges across the boundary); end prefixes with a "
                    "newline or start texts with the space"
                )
        return hit

    def _strip_eos(self, prefix: str, ids: list[int]) -> list[int]:
        eos = self.tok.eos_token_id
        if eos is None or not ids or ids[-1] != eos:
            return ids
        plain = self.tok(prefix, add_special_tokens=False)["input_ids"]
        if not plain or ids[-1 - len(plain) : -1] != plain:
            return ids  # the EOS is the prefix's own text (or a BOS that doubles as EOS)
        self._warn(
            "the tokenizer appends EOS to every text: Forge drops it from prefixes (it would sit "
            "between prefix and text) and keeps it at the end of rows without a prefix"
        )
        return ids[:-1]


class PairEncoder:
    """lm-evaluation-harness's encoding of (context, continuation) with one tokenizer (`_encode_pair`).

    The context's trailing whitespace moves to the start of the continuation; ``ctx = enc(context)``,
    ``whole = enc(context + continuation)`` and the continuation's tokens are ``whole[len(ctx):]``.
    ``enc`` adds what the tokenizer puts before every text (a BOS) unless ``add_special_tokens`` is
    false or the text starts with the BOS's text already (a chat template's output: lm-eval's
    `has_bos_prefix`), and never keeps a trailing EOS. An empty context is the BOS (or EOS when
    there is none)."""

    RULE = (
        "lm-eval encode_pair: trailing context whitespace to continuation; cont = enc(ctx+cont)[len(enc(ctx)):]; "
        "no second BOS before a text starting with its text (v2)"
    )

    def __init__(self, tokenizer, add_special_tokens: bool):
        self.tok = tokenizer
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a", add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        self.start = list(full[:at]) if add_special_tokens else []  # what precedes every text (BOS)
        self.dropped_eos = add_special_tokens and len(full) > at + len(plain)
        bos = tokenizer.bos_token_id
        self.empty_context = [bos if bos is not None else tokenizer.eos_token_id]
        self.start_text = tokenizer.decode(self.empty_context) if self.start else None

    def start_of(self, text: str) -> list[int]:
        """What precedes the text's own tokens: the start, unless the text begins with its text."""
        return [] if self.start_text and text.startswith(self.start_text) else self.start

    def enc(self, text: str) -> list[int]:
        return self.start_of(text) + list(self.tok(text, add_special_tokens=False)["input_ids"])

    def pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """`pair` of each (context, continuation), in two tokenizer calls over the whole list (a
        fast tokenizer encodes a list in parallel) and each distinct context encoded once."""
        moved = []
        for context, continuation in pairs:
            spaces = len(context) - len(context.rstrip())
            moved.append((context[:-spaces], context[-spaces:] + continuation) if spaces else (context, continuation))
        contexts = list(dict.fromkeys(c for c, _ in moved if c))
        ids = self._encode(contexts)
        ctx_ids = {c: self.start_of(c) + i for c, i in zip(contexts, ids)}
        wholes = iter(self._encode([c + t for c, t in moved if ctx_ids.get(c)]))
        empty = iter(self._encode([t for c, t in moved if not ctx_ids.get(c)]))
        out = []
        for c, _ in moved:
            ctx = ctx_ids.get(c)
            if not ctx:  # nothing to predict the first token from: the BOS (or EOS) stands in
                out.append((list(self.empty_context), next(empty)))
            else:
                out.append((ctx, (self.start_of(c) + next(wholes))[len(ctx) :]))
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [list(i) for i in self.tok(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.enc(context) if context else []
        if not ctx:  # nothing to predict the first token from: the BOS (or EOS) stands in
            return list(self.empty_context), list(self.tok(continuation, add_special_tokens=False)["input_ids"])
        whole = self.enc(context + continuation)
        return ctx, whole[len(ctx) :]
