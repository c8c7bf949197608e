"""What generation adds around the decoder: per-row limits, stop strings, finish reasons, step figures, states.

Model: a Forge batch is a set of prompts that one worker generates to completion with Forge's
continuous-batching decoder (`forge.runtime.decoder.engine`). Around it: per-row ``max_new_tokens`` and
stop strings (the text is cut before the first stop string; the tokens keep the one that
completed it, as `generate`'s stop strings do), a finish reason, the step sizes the decoder ran (a
histogram: the ledger checks no step went over the budget), and the activations of the generated
tokens, from Forge's own exact forward pass over each final sequence (`CausalLMRunner`, rows of
whole sequences: they equal a plain forward over it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowLimits:
    """`ItemMeta.data` of a generate item: its own limits."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Generated:
    """One prompt's outcome."""

    ids: list[int]
    text: str
    finish_reason: str  # length | stop | eos


def cut_at_stop(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[list[int], str, bool]:
    """(the ids up to the token that completes the first stop string, the text before it, whether one
    was found); without one, all of them and their text."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return ids, text, False
    at, s = min(hits)
    end = at + len(s)
    for k in range(1, len(ids) + 1):  # the first prefix of the ids whose text holds the stop string whole
        if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= end:
            return ids[:k], text[:at], True
    return ids, text[:at], True


def finish(tokenizer: Any, ids: list[int], limits: RowLimits, eos: set[int]) -> Generated:
    """A sequence's outcome from its generated ids: cut at a stop string, else ended by eos or length."""
    ids, text, stopped = cut_at_stop(tokenizer, ids[: limits.max_new_tokens], limits.stop)
    if stopped:
        return Generated(ids, text, "stop")
    if ids and ids[-1] in eos:
        return Generated(ids, text, "eos")
    return Generated(ids, text, "length")


def step_histogram(steps: list[int], budget: int) -> dict[str, int]:
    """Steps by their query tokens, in power-of-two bins up to the budget ("<=B": steps of at most B tokens)."""
    bins: Counter[str] = Counter()
    edges = [1 << k for k in range(max(1, int(budget).bit_length()) + 1)]
    for n in steps:
        bins[f"<={next((e for e in edges if n <= e), n)}"] += 1
    return dict(sorted(bins.items(), key=lambda kv: int(kv[0][2:])))


def final_states(
    runner: Any, items: list[Any], generated: list[list[int]], from_prompt: bool, budget: int
) -> list[dict]:
    """Per item, {layer or point: [tokens, ...]}: the states of its generated tokens (and its prompt's
    own tokens before them, `from_prompt`) from a plain forward over the final sequence; sequences
    of similar length together, at most `budget` padded tokens a forward pass (a step's)."""
    from forge.vocab.geometry import Batch, Item

    seqs = [
        Item(it.id, len(it.tokens) + len(g), None, 0, [*it.tokens, *g], None, it.index)
        for it, g in zip(items, generated)
    ]
    out: list[dict] = [{} for _ in items]
    order = sorted(range(len(seqs)), key=lambda k: seqs[k].num_tokens)
    while order:
        part = [order.pop()]  # the longest left heads the pass
        width = seqs[part[0]].num_tokens
        while order and (len(part) + 1) * width <= budget:
            part.append(order.pop())
        states = runner.forward_tokens(Batch([[seqs[k]] for k in part], width))
        for j, k in enumerate(part):
            it = items[k]
            first = it.prefix_len if from_prompt else len(it.tokens)
            row, start, n = int(states.item_row[j]), int(states.starts[j]), int(states.lens[j])
            for layer, i in zip(runner.layers, runner._layer_idx):
                out[k][f"layer_{layer}"] = states.hidden[i][row, start + first : start + n]
            for name, value in states.captured.items():
                out[k][name] = value[row, start + first : start + n].flatten(1)
    return out
