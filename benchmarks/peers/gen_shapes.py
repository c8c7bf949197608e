"""The generate benchmark's prompt shapes: today's short one and a long-prefix few-shot one.

- ``short``: the embedded prompts as they are (`functions/assets/prompts.jsonl`): 40 few-shot
  prefixes of about 62 tokens (an instruction, three solved statements) and about 11 own tokens.
- ``long``: the same 40 groups grown into long few-shot prompts: each prefix takes solved
  statements (from every group's shots, in turn) until it holds 300-400 tokens (its own target in
  that range, by group), and each prompt's own text is its statement after a few other statements
  of its group given as context, about 50 tokens. Deterministic: no randomness, the same rows
  every time.
"""

from __future__ import annotations

from typing import Any

SHAPES = ("short", "long")


def rows(shape: str, base: list[dict], tokenizer: Any) -> list[dict]:
    """The benchmark's rows ``{"id", "prefix", "prompt"}`` of `shape`, from the embedded rows `base`."""
    if shape == "short":
        return base
    if shape != "long":
        raise ValueError(f"--shape {shape!r}: one of {', '.join(SHAPES)}")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    groups = list(dict.fromkeys(r["prefix"] for r in base))
    shots = [line + "\n" for p in groups for line in p.splitlines()[1:]]  # every group's solved statements
    statements = {p: [r["prompt"] for r in base if r["prefix"] == p] for p in groups}
    prefixes = {}
    for g, p in enumerate(groups):
        target, text, k = 300 + (g * 37) % 90, p, g * 3
        while count(text) < target and count(text + shots[k % len(shots)]) <= 400:
            text, k = text + shots[k % len(shots)], k + 1
        prefixes[p] = text
    out = []
    for n, r in enumerate(base):
        mine = statements[r["prefix"]]
        context, k = "", 1
        while count(context + r["prompt"]) < 40 + n % 10:
            other = mine[(mine.index(r["prompt"]) + k) % len(mine)].replace(" Answer:", "")
            context, k = context + other + " ", k + 1
        out.append({"id": r["id"], "prefix": prefixes[r["prefix"]], "prompt": "Given: " + context + r["prompt"]})
    return out
