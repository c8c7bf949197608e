"""The facts the embedded datasets are drawn from, and the generators that turn them into
true and false statements (`build_statement_pools`). `build_assets` builds statements.jsonl
from them, `build_multiple_choice` multiple_choice.jsonl. Deterministic: every draw comes
from the `random.Random` passed in.
"""

from __future__ import annotations

import random

# --------------------------------------------------------------------------
# Facts
# --------------------------------------------------------------------------

# (country as written mid-sentence, capital, continent)
COUNTRIES = [
    ("France", "Paris", "Europe"),
    ("Germany", "Berlin", "Europe"),
    ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"),
    ("Portugal", "Lisbon", "Europe"),
    ("the United Kingdom", "London", "Europe"),
    ("Ireland", "Dublin", "Europe"),
    ("the Netherlands", "Amsterdam", "Europe"),
    ("Belgium", "Brussels", "Europe"),
    ("Austria", "Vienna", "Europe"),
    ("Switzerland", "Bern", "Europe"),
    ("Poland", "Warsaw", "Europe"),
    ("Sweden", "Stockholm", "Europe"),
    ("Norway", "Oslo", "Europe"),
    ("Finland", "Helsinki", "Europe"),
    ("Denmark", "Copenhagen", "Europe"),
    ("Greece", "Athens", "Europe"),
    ("Hungary", "Budapest", "Europe"),
    ("the Czech Republic", "Prague", "Europe"),
    ("Romania", "Bucharest", "Europe"),
    ("Bulgaria", "Sofia", "Europe"),
    ("Serbia", "Belgrade", "Europe"),
    ("Croatia", "Zagreb", "Europe"),
    ("Ukraine", "Kyiv", "Europe"),
    ("Iceland", "Reykjavik", "Europe"),
    ("Estonia", "Tallinn", "Europe"),
    ("Latvia", "Riga", "Europe"),
    ("Lithuania", "Vilnius", "Europe"),
    ("Japan", "Tokyo", "Asia"),
    ("China", "Beijing", "Asia"),
    ("South Korea", "Seoul", "Asia"),
    ("India", "New Delhi", "Asia"),
    ("Thailand", "Bangkok", "Asia"),
    ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"),
    ("the Philippines", "Manila", "Asia"),
    ("Malaysia", "Kuala Lumpur", "Asia"),
    ("Pakistan", "Islamabad", "Asia"),
    ("Bangladesh", "Dhaka", "Asia"),
    ("Nepal", "Kathmandu", "Asia"),
    ("Iran", "Tehran", "Asia"),
    ("Iraq", "Baghdad", "Asia"),
    ("Saudi Arabia", "Riyadh", "Asia"),
    ("Mongolia", "Ulaanbaatar", "Asia"),
    ("Afghanistan", "Kabul", "Asia"),
    ("Syria", "Damascus", "Asia"),
    ("Egypt", "Cairo", "Africa"),
    ("Kenya", "Nairobi", "Africa"),
    ("Nigeria", "Abuja", "Africa"),
    ("Ethiopia", "Addis Ababa", "Africa"),
    ("Ghana", "Accra", "Africa"),
    ("Morocco", "Rabat", "Africa"),
    ("Algeria", "Algiers", "Africa"),
    ("Tunisia", "Tunis", "Africa"),
    ("Senegal", "Dakar", "Africa"),
    ("Uganda", "Kampala", "Africa"),
    ("Zimbabwe", "Harare", "Africa"),
    ("Angola", "Luanda", "Africa"),
    ("Sudan", "Khartoum", "Africa"),
    ("Mali", "Bamako", "Africa"),
    ("Canada", "Ottawa", "North America"),
    ("Mexico", "Mexico City", "North America"),
    ("the United States", "Washington", "North America"),
    ("Cuba", "Havana", "North America"),
    ("Jamaica", "Kingston", "North America"),
    ("Panama", "Panama City", "North America"),
    ("Guatemala", "Guatemala City", "North America"),
    ("Honduras", "Tegucigalpa", "North America"),
    ("Brazil", "Brasilia", "South America"),
    ("Argentina", "Buenos Aires", "South America"),
    ("Chile", "Santiago", "South America"),
    ("Peru", "Lima", "South America"),
    ("Colombia", "Bogota", "South America"),
    ("Venezuela", "Caracas", "South America"),
    ("Ecuador", "Quito", "South America"),
    ("Uruguay", "Montevideo", "South America"),
    ("Paraguay", "Asuncion", "South America"),
    ("Bolivia", "Sucre", "South America"),
    ("Australia", "Canberra", "Oceania"),
    ("New Zealand", "Wellington", "Oceania"),
    ("Fiji", "Suva", "Oceania"),
    ("Papua New Guinea", "Port Moresby", "Oceania"),
]
CONTINENTS = sorted({c for _, _, c in COUNTRIES})

# Animals ordered by typical adult size (smallest first).  Only pairs at least
# MIN_SIZE_GAP apart are compared, so every comparison is unambiguous.
ANIMALS_BY_SIZE = [
    "ant",
    "bee",
    "fly",
    "spider",
    "butterfly",
    "mouse",
    "frog",
    "sparrow",
    "hamster",
    "rat",
    "squirrel",
    "pigeon",
    "rabbit",
    "chicken",
    "cat",
    "duck",
    "fox",
    "goose",
    "dog",
    "sheep",
    "wolf",
    "pig",
    "deer",
    "lion",
    "tiger",
    "gorilla",
    "bear",
    "horse",
    "camel",
    "giraffe",
    "rhinoceros",
    "hippopotamus",
    "elephant",
    "blue whale",
]
MIN_SIZE_GAP = 6

ANIMAL_CLASSES = {
    "mammal": [
        "dog",
        "cat",
        "horse",
        "cow",
        "whale",
        "dolphin",
        "bat",
        "elephant",
        "lion",
        "tiger",
        "rabbit",
        "mouse",
        "bear",
        "monkey",
        "giraffe",
        "kangaroo",
        "sheep",
        "goat",
        "pig",
        "wolf",
        "fox",
        "deer",
        "camel",
    ],
    "bird": [
        "eagle",
        "sparrow",
        "penguin",
        "owl",
        "parrot",
        "duck",
        "ostrich",
        "pigeon",
        "crow",
        "swan",
        "flamingo",
        "hawk",
        "robin",
        "chicken",
    ],
    "fish": ["salmon", "trout", "shark", "tuna", "cod", "goldfish", "carp", "herring"],
    "reptile": ["snake", "lizard", "crocodile", "turtle", "iguana", "alligator", "gecko"],
    "insect": ["ant", "bee", "butterfly", "beetle", "mosquito", "grasshopper", "wasp", "moth"],
    "amphibian": ["frog", "toad", "salamander", "newt"],
}

COLOURS = ["red", "orange", "yellow", "green", "blue", "purple", "white", "black", "brown", "pink"]
OBJECT_COLOURS = [
    ("a ripe banana", "yellow"),
    ("fresh snow", "white"),
    ("coal", "black"),
    ("fresh grass", "green"),
    ("a clear daytime sky", "blue"),
    ("a ripe tomato", "red"),
    ("milk", "white"),
    ("a lemon", "yellow"),
    ("a carrot", "orange"),
    ("an orange", "orange"),
    ("chocolate", "brown"),
    ("a flamingo", "pink"),
    ("an emerald", "green"),
    ("a ruby", "red"),
    ("a sapphire", "blue"),
    ("an amethyst", "purple"),
    ("a lime", "green"),
    ("charcoal", "black"),
    ("a polar bear", "white"),
    ("a crow", "black"),
    ("a fire truck", "red"),
    ("a pumpkin", "orange"),
    ("an eggplant", "purple"),
    ("a strawberry", "red"),
    ("a school bus", "yellow"),
    ("chalk", "white"),
    ("a cucumber", "green"),
    ("a grizzly bear", "brown"),
    ("a blueberry", "blue"),
    ("a canary", "yellow"),
]

OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("light", "dark"),
    ("fast", "slow"),
    ("old", "young"),
    ("happy", "sad"),
    ("open", "closed"),
    ("wet", "dry"),
    ("early", "late"),
    ("hard", "soft"),
    ("full", "empty"),
    ("rich", "poor"),
    ("loud", "quiet"),
    ("strong", "weak"),
    ("thick", "thin"),
    ("tall", "short"),
    ("heavy", "light"),
    ("left", "right"),
    ("true", "false"),
    ("inside", "outside"),
    ("above", "below"),
    ("day", "night"),
    ("win", "lose"),
    ("buy", "sell"),
    ("push", "pull"),
    ("first", "last"),
    ("north", "south"),
    ("east", "west"),
    ("clean", "dirty"),
]

MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

ELEMENTS = [
    ("hydrogen", "H"),
    ("helium", "He"),
    ("carbon", "C"),
    ("nitrogen", "N"),
    ("oxygen", "O"),
    ("sodium", "Na"),
    ("magnesium", "Mg"),
    ("aluminium", "Al"),
    ("silicon", "Si"),
    ("phosphorus", "P"),
    ("sulfur", "S"),
    ("chlorine", "Cl"),
    ("potassium", "K"),
    ("calcium", "Ca"),
    ("iron", "Fe"),
    ("copper", "Cu"),
    ("zinc", "Zn"),
    ("silver", "Ag"),
    ("tin", "Sn"),
    ("gold", "Au"),
    ("mercury", "Hg"),
    ("lead", "Pb"),
    ("uranium", "U"),
    ("neon", "Ne"),
    ("nickel", "Ni"),
]

# (subject, value) pairs never used as "false" statements because they are
# arguably true (transcontinental countries, borderline colours).
AMBIGUOUS = {
    ("Egypt", "Asia"),
    ("Iran", "Europe"),
    ("Panama", "South America"),
    ("chocolate", "black"),
    ("a blueberry", "purple"),
    ("an amethyst", "pink"),
    ("a grizzly bear", "black"),
    ("an eggplant", "black"),
    ("a ripe tomato", "orange"),
    ("a carrot", "red"),
    ("a flamingo", "red"),
    ("a flamingo", "orange"),
    ("a lime", "yellow"),
    ("a lemon", "green"),
    ("a canary", "orange"),
}

NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
LEGS = [
    ("A spider", 8),
    ("A dog", 4),
    ("A chicken", 2),
    ("An ant", 6),
    ("A horse", 4),
    ("A duck", 2),
    ("A beetle", 6),
    ("A cat", 4),
    ("An octopus", 8),
    ("A snake", 0),
    ("A human", 2),
    ("A bee", 6),
    ("A cow", 4),
    ("A crab", 10),
    ("An ostrich", 2),
    ("A fish", 0),
    ("A frog", 4),
    ("A butterfly", 6),
    ("A scorpion", 8),
    ("A penguin", 2),
]


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
