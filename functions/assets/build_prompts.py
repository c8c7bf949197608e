"""Build the embedded prompts for ``generate``: ``prompts.jsonl``.

Run from the repository root::

    python -m forge.functions.assets.build_prompts

500 rows ``{"id", "prefix", "prompt"}``: 40 few-shot prefixes (an instruction and three solved
statements), each shared by the prompts after it, and a statement to continue ("Statement: ...
Answer:"), drawn from the embedded statements. Deterministic: a fixed seed, byte-identical output.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
OUT_FILE = ASSETS_DIR / "prompts.jsonl"
SEED = 20261203
N_PROMPTS = 500
N_PREFIXES = 40
SHOTS = 3
INSTRUCTION = "Say whether each statement is true or false, then explain why.\n"


def build() -> list[dict]:
    rows = [json.loads(line) for line in (ASSETS_DIR / "statements.jsonl").read_text().splitlines()]
    rng = random.Random(SEED)
    answer = {0: "False", 1: "True"}
    prefixes = []
    for _ in range(N_PREFIXES):
        shots = rng.sample(rows, SHOTS)
        prefixes.append(INSTRUCTION + "".join(f"Statement: {r['text']} Answer: {answer[r['label']]}\n" for r in shots))
    out = []
    for k in range(N_PROMPTS):
        row = rows[rng.randrange(len(rows))]
        out.append(
            {"id": f"g{k + 1:04d}", "prefix": prefixes[k % N_PREFIXES], "prompt": f"Statement: {row['text']} Answer:"}
        )
    return out


def main() -> None:
    OUT_FILE.write_text("".join(json.dumps(r) + "\n" for r in build()))


if __name__ == "__main__":
    main()
