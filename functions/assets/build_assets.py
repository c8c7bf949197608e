"""Build the embedded default dataset and model description for ``probe_gen``.

Run from the repository root::

    python -m forge.functions.assets.build_assets          # or: python functions/assets/build_assets.py

It writes, next to this file:

* ``statements.jsonl``  - labelled true/false statements with few-shot prefixes
* ``tiny-llama/``       - a weightless Hugging Face model dir: ``config.json``,
  ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
  ``forge_init.json`` (weights are created on demand by
  :func:`forge.functions.assets.materialize_model`).

The statements come from the facts of ``facts.json`` and the generators of ``facts.py``. Everything is
deterministic: re-running the script reproduces byte-identical files (fixed seeds, sorted
iteration, no timestamps, no library versions written).  Only ``tokenizers`` is needed (no
torch / transformers).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from forge.functions.assets.facts import build_statement_pools

ASSETS_DIR = Path(__file__).resolve().parent
DATASET_FILE = ASSETS_DIR / "statements.jsonl"
MODEL_DIR = ASSETS_DIR / "tiny-llama"

SEED = 20240611
N_PER_LABEL = 1250  # -> 2,500 rows
NO_PREFIX_FRACTION = 0.02
TEMPLATE_CAP = 300  # max candidate rows per template and label
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
PREFIX_TARGETS = [20, 50, 100, 200, 350]  # approximate token lengths
INIT_SEED = 1234

# --------------------------------------------------------------------------
# Few-shot prefixes
# --------------------------------------------------------------------------

INSTRUCTIONS = [
    "Is the statement true or false?\n",
    "Decide whether each statement is true or false.\n",
    "Label every statement below as True if it is factually correct and False otherwise.\n",
    "You are a careful fact checker. For each statement, answer True if it is correct and False if it is wrong.\n",
    "The following are statements about geography, arithmetic, animals, colours and other everyday facts. "
    "Read each one carefully and answer True if the statement is correct, or False if it is incorrect.\n",
]


def make_prefix(instruction: str, examples: list[tuple[str, int]], k: int) -> str:
    lines = [instruction]
    for text, label in examples[:k]:
        lines.append(f"Statement: {text} Answer: {'True' if label else 'False'}\n")
    return "".join(lines)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=0,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = "<s>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return tok


def ntokens(tok: Tokenizer, s: str) -> int:
    return len(tok.encode(s, add_special_tokens=False).ids)


# --------------------------------------------------------------------------
# Main build
# --------------------------------------------------------------------------


def build(out_dir: Path = ASSETS_DIR, verbose: bool = True) -> dict:
    rng = random.Random(SEED)
    pools = build_statement_pools(rng)
    names = sorted(pools)
    fewshot_pool, held = _fewshot_pool(pools, names)
    rows = _dataset_rows(rng, pools, names, held)
    texts = [s for s, _ in rows]
    prefixes, ks, tok = _choose_prefixes(fewshot_pool, texts)
    prefix_lens = [ntokens(tok, p) for p in prefixes]
    records = _assign_prefixes(rows, prefixes)
    _check_invariants(prefixes, records, tok)

    # ---- write dataset
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / DATASET_FILE.name, "w", encoding="utf-8", newline="\n") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    _write_model_dir(out_dir / MODEL_DIR.name, tok)

    n_pos = sum(r["label"] for r in records)
    info = {
        "rows": len(records),
        "label_1": n_pos,
        "label_0": len(records) - n_pos,
        "no_prefix_rows": sum("prefix" not in r for r in records),
        "prefix_examples": ks,
        "prefix_tokens": prefix_lens,
        "prefix_rows": [sum(r.get("prefix") == p for r in records) for p in prefixes],
        "vocab_size": tok.get_vocab_size(),
        "templates": {n: (len(pools[n][0]), len(pools[n][1])) for n in names},
    }
    if verbose:
        print(json.dumps(info, indent=1))
    return info


def _fewshot_pool(pools: dict, names: list[str]) -> tuple[list[tuple[str, int]], set[str]]:
    """Few-shot examples held out (never used as dataset rows): (statement, label) pairs and
    the set of their statements."""
    fewshot_pool: list[tuple[str, int]] = []
    held: set[str] = set()
    ex_rng = random.Random(SEED + 1)
    while len(fewshot_pool) < 60:
        name = names[len(fewshot_pool) % len(names)]
        label = len(fewshot_pool) % 2
        cand = pools[name][0 if label else 1]
        s = ex_rng.choice(cand)
        if s not in held:
            held.add(s)
            fewshot_pool.append((s, 1 if label else 0))
    return fewshot_pool, held


def _dataset_rows(rng: random.Random, pools: dict, names: list[str], held: set[str]) -> list[tuple[str, int]]:
    """The dataset's (statement, label) rows, N_PER_LABEL of each label, shuffled."""

    # Candidate rows.  Cap each template so the big generators (sizes, arithmetic) do not dominate.
    def capped(idx: int) -> list[str]:
        out = []
        for n in names:
            items = [s for s in pools[n][idx] if s not in held]
            rng.shuffle(items)
            out.extend(items[:TEMPLATE_CAP])
        return out

    true_c, false_c = capped(0), capped(1)
    assert len(true_c) >= N_PER_LABEL and len(false_c) >= N_PER_LABEL, (len(true_c), len(false_c))
    rows = [(s, 1) for s in rng.sample(true_c, N_PER_LABEL)] + [(s, 0) for s in rng.sample(false_c, N_PER_LABEL)]
    rng.shuffle(rows)
    return rows


def _choose_prefixes(fewshot_pool: list[tuple[str, int]], texts: list[str]) -> tuple[list[str], list[int], Tokenizer]:
    """(prefixes, examples per prefix, the tokenizer trained on prefixes + texts)."""
    # Per-prefix example orderings (each prefix draws its own shuffled examples).
    orders = []
    for i in range(len(PREFIX_TARGETS)):
        ex = list(fewshot_pool)
        random.Random(SEED + 100 + i).shuffle(ex)
        orders.append(ex)

    # Fixed-point iteration: tokenizer trained on (prefixes + texts); choose the
    # example count k per prefix that lands closest to its target length.
    ks = [0, 2, 6, 13, 24]
    for _ in range(10):
        prefixes = [make_prefix(INSTRUCTIONS[i], orders[i], ks[i]) for i in range(len(ks))]
        tok = train_tokenizer(prefixes + texts)
        new_ks = []
        for i, target in enumerate(PREFIX_TARGETS):
            best = min(
                range(len(fewshot_pool) + 1),
                key=lambda k: (abs(ntokens(tok, make_prefix(INSTRUCTIONS[i], orders[i], k)) - target), k),
            )
            new_ks.append(best)
        if new_ks == ks:
            break
        ks = new_ks
    else:
        raise RuntimeError("prefix length selection did not converge")
    prefixes = [make_prefix(INSTRUCTIONS[i], orders[i], ks[i]) for i in range(len(ks))]
    return prefixes, ks, train_tokenizer(prefixes + texts)


def _assign_prefixes(rows: list[tuple[str, int]], prefixes: list[str]) -> list[dict]:
    """The dataset's records: prefixes assigned deterministically at random; ~2% rows without prefix."""
    assign_rng = random.Random(SEED + 7)
    records = []
    for i, (text, label) in enumerate(rows):
        rec = {"id": f"s{i + 1:05d}"}
        if assign_rng.random() >= NO_PREFIX_FRACTION:
            rec["prefix"] = prefixes[assign_rng.randrange(len(prefixes))]
        rec["text"] = text
        rec["label"] = label
        records.append(rec)
    return records


def _check_invariants(prefixes: list[str], records: list[dict], tok: Tokenizer) -> None:
    """Invariants the probe code relies on."""
    for p in prefixes:
        assert p.endswith("\n") and not p[-2].isspace(), repr(p[-5:])
    for rec in records:
        assert rec["text"] and not rec["text"][0].isspace()
        if "prefix" in rec:
            joined = tok.encode(rec["prefix"] + rec["text"], add_special_tokens=False).ids
            split = (
                tok.encode(rec["prefix"], add_special_tokens=False).ids
                + tok.encode(rec["text"], add_special_tokens=False).ids
            )
            assert joined == split, rec["id"]
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()


def _write_model_dir(mdir: Path, tok: Tokenizer) -> None:
    """The model directory: tokenizer, config and init file (weights are made at first use)."""
    mdir.mkdir(parents=True, exist_ok=True)
    tok.save(str(mdir / "tokenizer.json"), pretty=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "torch_dtype": "float32",
    }
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": 2048,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    _write_json(mdir / "config.json", config)
    _write_json(mdir / "tokenizer_config.json", tok_config)
    _write_json(mdir / "special_tokens_map.json", special_map)
    _write_json(mdir / "forge_init.json", {"seed": INIT_SEED, "format": "safetensors"})


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS_DIR
    build(out)
