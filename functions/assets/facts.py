"""The generators that turn the facts of ``facts.json`` into true and false statements
(`build_statement_pools`). `build_assets` builds statements.jsonl from them,
`build_multiple_choice` multiple_choice.jsonl. Deterministic: every draw comes from the
`random.Random` passed in.

The facts (data, in ``facts.json`` next to this file):

* ``countries``: (country as written mid-sentence, capital, continent);
* ``animals_by_size``: animals ordered by typical adult size (smallest first); only pairs at
  least ``min_size_gap`` apart are compared, so every comparison is unambiguous;
* ``animal_classes``, ``colours``, ``object_colours``, ``opposites``, ``months``, ``days``,
  ``elements``, ``number_words``, ``legs``;
* ``ambiguous``: (subject, value) pairs never used as "false" statements because they are
  arguably true (transcontinental countries, borderline colours).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_FACTS = json.loads((Path(__file__).parent / "facts.json").read_text(encoding="utf-8"))

COUNTRIES: list[tuple[str, str, str]] = [tuple(c) for c in _FACTS["countries"]]
CONTINENTS = sorted({c for _, _, c in COUNTRIES})
ANIMALS_BY_SIZE: list[str] = _FACTS["animals_by_size"]
MIN_SIZE_GAP: int = _FACTS["min_size_gap"]
ANIMAL_CLASSES: dict[str, list[str]] = _FACTS["animal_classes"]
COLOURS: list[str] = _FACTS["colours"]
OBJECT_COLOURS: list[tuple[str, str]] = [tuple(p) for p in _FACTS["object_colours"]]
OPPOSITES: list[tuple[str, str]] = [tuple(p) for p in _FACTS["opposites"]]
MONTHS: list[str] = _FACTS["months"]
DAYS: list[str] = _FACTS["days"]
ELEMENTS: list[tuple[str, str]] = [tuple(p) for p in _FACTS["elements"]]
AMBIGUOUS: set[tuple[str, str]] = {tuple(p) for p in _FACTS["ambiguous"]}
NUMBER_WORDS: list[str] = _FACTS["number_words"]
LEGS: list[tuple[str, int]] = [tuple(p) for p in _FACTS["legs"]]


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


# --------------------------------------------------------------------------
# Statement generators: each returns (true_list, false_list) of texts
# --------------------------------------------------------------------------


def gen_capitals(rng: random.Random):
    t, f = [], []
    caps = [c for _, c, _ in COUNTRIES]
    for country, capital, _ in COUNTRIES:
        wrong = rng.sample([c for c in caps if c != capital], 2)
        t.append(f"The capital of {country} is {capital}.")
        t.append(f"{capital} is the capital of {country}.")
        f.append(f"The capital of {country} is {wrong[0]}.")
        f.append(f"{wrong[1]} is the capital of {country}.")
    return t, f


def gen_continents(rng: random.Random):
    t, f = [], []
    for country, capital, cont in COUNTRIES:
        others = [c for c in CONTINENTS if c != cont and (country, c) not in AMBIGUOUS]
        t.append(f"{_cap(country)} is in {cont}.")
        f.append(f"{_cap(country)} is in {rng.choice(others)}.")
        t.append(f"{capital} is a city in {cont}.")
        f.append(f"{capital} is a city in {rng.choice(others)}.")
    return t, f


def gen_arithmetic(rng: random.Random, n: int):
    t, f = set(), set()
    while len(t) < n or len(f) < n:
        op = rng.choice(["plus", "minus", "times"])
        if op == "plus":
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            c = a + b
        elif op == "minus":
            a = rng.randint(2, 99)
            b = rng.randint(1, a - 1)
            c = a - b
        else:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            c = a * b
        if rng.random() < 0.5:
            if len(t) < n:
                t.add(f"{a} {op} {b} equals {c}.")
        else:
            delta = rng.choice([-10, -2, -1, 1, 2, 10]) if op != "times" else rng.choice([-a, -1, 1, a, b])
            wrong = c + delta
            if wrong >= 0 and wrong != c and len(f) < n:
                f.add(f"{a} {op} {b} equals {wrong}.")
    return sorted(t), sorted(f)


def gen_number_comparisons(rng: random.Random, n: int):
    t, f = set(), set()
    while len(t) < n or len(f) < n:
        a, b = rng.sample(range(1, 500), 2)
        rel = rng.choice(["greater", "less"])
        truth = (a > b) if rel == "greater" else (a < b)
        bucket = t if truth else f
        if len(bucket) < n:
            bucket.add(f"{a} is {rel} than {b}.")
    return sorted(t), sorted(f)


def gen_sizes(rng: random.Random):
    t, f = [], []
    n = len(ANIMALS_BY_SIZE)
    for i in range(n):
        for j in range(n):
            if abs(i - j) < MIN_SIZE_GAP:
                continue
            x, y = ANIMALS_BY_SIZE[i], ANIMALS_BY_SIZE[j]
            for rel, truth in (("larger", i > j), ("smaller", i < j)):
                s = f"{_cap(_article(x))} {x} is {rel} than {_article(y)} {y}."
                (t if truth else f).append(s)
    return t, f


def gen_classes(rng: random.Random):
    t, f = [], []
    classes = sorted(ANIMAL_CLASSES)
    for cls in classes:
        for animal in ANIMAL_CLASSES[cls]:
            t.append(f"{_cap(_article(animal))} {animal} is {_article(cls)} {cls}.")
            for other in rng.sample([c for c in classes if c != cls], 2):
                f.append(f"{_cap(_article(animal))} {animal} is {_article(other)} {other}.")
    return t, f


def gen_colours(rng: random.Random):
    t, f = [], []
    for obj, colour in OBJECT_COLOURS:
        t.append(f"The colour of {obj} is {colour}.")
        for other in rng.sample([c for c in COLOURS if c != colour and (obj, c) not in AMBIGUOUS], 3):
            f.append(f"The colour of {obj} is {other}.")
    return t, f


def gen_opposites(rng: random.Random):
    t, f = [], []
    words = sorted({w for p in OPPOSITES for w in p})
    opp: dict[str, set[str]] = {w: set() for w in words}
    for a, b in OPPOSITES:
        opp[a].add(b)
        opp[b].add(a)
    for a, b in OPPOSITES:
        t.append(f"The opposite of {a} is {b}.")
        t.append(f"The opposite of {b} is {a}.")
        # A word may have several opposites ("light": "dark", "heavy").
        bad_a = rng.choice([w for w in words if w != a and w not in opp[a]])
        bad_b = rng.choice([w for w in words if w != b and w not in opp[b]])
        f.append(f"The opposite of {a} is {bad_a}.")
        f.append(f"The opposite of {b} is {bad_b}.")
    return t, f


def gen_calendar(rng: random.Random):
    t, f = [], []
    for seq, kind in ((MONTHS, "month"), (DAYS, "day")):
        n = len(seq)
        for i, x in enumerate(seq):
            nxt, prv = seq[(i + 1) % n], seq[(i - 1) % n]
            t.append(f"The {kind} after {x} is {nxt}.")
            t.append(f"The {kind} before {x} is {prv}.")
            bad = rng.sample([y for y in seq if y not in (x, nxt, prv)], 2)
            f.append(f"The {kind} after {x} is {bad[0]}.")
            f.append(f"The {kind} before {x} is {bad[1]}.")
    return t, f


def gen_elements(rng: random.Random):
    t, f = [], []
    symbols = [s for _, s in ELEMENTS]
    for name, sym in ELEMENTS:
        t.append(f"The chemical symbol for {name} is {sym}.")
        for other in rng.sample([s for s in symbols if s != sym], 2):
            f.append(f"The chemical symbol for {name} is {other}.")
    return t, f


def gen_legs(rng: random.Random):
    t, f = [], []
    for who, n in LEGS:
        t.append(f"{who} has {NUMBER_WORDS[n]} legs.")
        for other in rng.sample([k for k in (0, 2, 4, 6, 8, 10) if k != n], 2):
            f.append(f"{who} has {NUMBER_WORDS[other]} legs.")
    return t, f


# (generator, max rows per label taken into the dataset)
def build_statement_pools(rng: random.Random):
    pools = {
        "capital": gen_capitals(rng),
        "continent": gen_continents(rng),
        "arithmetic": gen_arithmetic(rng, 500),
        "compare_numbers": gen_number_comparisons(rng, 300),
        "size": gen_sizes(rng),
        "class": gen_classes(rng),
        "colour": gen_colours(rng),
        "opposite": gen_opposites(rng),
        "calendar": gen_calendar(rng),
        "element": gen_elements(rng),
        "legs": gen_legs(rng),
    }
    out = {}
    for name, (t, f) in pools.items():
        t, f = sorted(set(t)), sorted(set(f))
        assert not set(t) & set(f), name
        out[name] = (t, f)
    return out
