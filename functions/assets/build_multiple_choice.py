"""Build the embedded multiple-choice set for ``score``: ``multiple_choice.jsonl``.

Run from the repository root::

    python -m forge.functions.assets.build_multiple_choice

Each row is ``{"id", "context", "choices", "gold"}``: a few-shot context (an instruction and
three solved questions of the same kind, then the question, ending in "Answer:") and four
choices, one of them right, drawn from the facts (``facts.py``) the statements are built from too.
Deterministic: a fixed seed, sorted iteration, byte-identical output on every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from forge.functions.assets.facts import ANIMAL_CLASSES, COUNTRIES, ELEMENTS, OBJECT_COLOURS

ASSETS_DIR = Path(__file__).resolve().parent
OUT_FILE = ASSETS_DIR / "multiple_choice.jsonl"
SEED = 20261130
N_QUESTIONS = 320
SHOTS = 3
INSTRUCTION = "Answer each question with one of the four options.\n\n"


def _kinds() -> dict[str, list[tuple[str, str, list[str]]]]:
    """kind -> [(question, answer, pool of wrong answers)]"""
    capitals = sorted({c for _, c, _ in COUNTRIES})
    continents = sorted({c for _, _, c in COUNTRIES})
    colours = sorted({c for _, c in OBJECT_COLOURS})
    classes = sorted(ANIMAL_CLASSES)
    symbols = sorted({s for _, s in ELEMENTS})
    return {
        "capital": [
            (f"What is the capital of {country}?", cap, [c for c in capitals if c != cap])
            for country, cap, _ in COUNTRIES
        ],
        "continent": [
            (f"On which continent is {country}?", cont, [c for c in continents if c != cont])
            for country, _, cont in COUNTRIES
        ],
        "colour": [
            (f"What colour is {thing}?", col, [c for c in colours if c != col]) for thing, col in OBJECT_COLOURS
        ],
        "class": [
            (f"What kind of animal is a {animal}?", cls, [c for c in classes if c != cls])
            for cls in classes
            for animal in ANIMAL_CLASSES[cls]
        ],
        "element": [
            (f"What is the chemical symbol for {name}?", sym, [s for s in symbols if s != sym])
            for name, sym in ELEMENTS
        ],
    }


def _options(rng: random.Random, answer: str, wrong: list[str]) -> tuple[list[str], int]:
    choices = rng.sample(wrong, 3) + [answer]
    rng.shuffle(choices)
    return choices, choices.index(answer)


def _block(question: str, choices: list[str]) -> str:
    letters = "ABCD"
    return f"Question: {question}\n" + "".join(f"{letters[i]}. {c}\n" for i, c in enumerate(choices)) + "Answer:"


def questions(n: int = N_QUESTIONS, shots: int = SHOTS, seed: int = SEED) -> list[dict]:
    """`n` rows, each with `shots` solved questions of its kind before it (benchmarks use more)."""
    rng = random.Random(seed)
    kinds = _kinds()
    names = sorted(kinds)
    rows = []
    for k in range(n):
        kind = names[k % len(names)]
        pool = kinds[kind]
        picked = rng.sample(range(len(pool)), min(shots, len(pool) - 1) + 1)
        context = INSTRUCTION
        for i in picked[:-1]:
            q, a, wrong = pool[i]
            choices, _ = _options(rng, a, wrong)
            context += _block(q, choices) + f" {a}\n\n"
        q, a, wrong = pool[picked[-1]]
        choices, gold = _options(rng, a, wrong)
        rows.append({"id": f"q{k:04d}", "context": context + _block(q, choices), "choices": choices, "gold": gold})
    return rows


def build(out: Path = OUT_FILE) -> int:
    rows = questions()
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


if __name__ == "__main__":
    print(f"{OUT_FILE}: {build()} questions")
