"""A benchmark model with a realistic FLOP mix (issue 20, item 3), and the FLOP arithmetic.

    python -m benchmarks realistic            # build (once) and print the path and FLOP shares

`llama-1024`: a Llama-style decoder made from a config at random weights, like the embedded
tiny-llama (same byte-level BPE tokenizer, vocabulary 2,048): hidden 1,024, intermediate
2,752 (2.6875x, Llama-2-7B's ratio), 16 query heads of 64 over 4 key-value heads
(grouped-query attention), 4 layers, 52 M parameters. Its weights are made from a fixed seed
by `forge.functions.assets.materialize_model` and cached under `$FORGE_CACHE/models/`
(default `~/.cache/forge`): every benchmark builds it once and loads it from there.

`flop_shares` gives attention's share of a forward pass's FLOPs for a set of sequences, next
to the embedded model's and Llama-2-7B's at the same lengths.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2752,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_cache": True,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "float32",
}
SEED = 20
# For the FLOP comparison only (never built): the embedded model and Llama-2-7B.
TINY = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 2048,
}
LLAMA2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "vocab_size": 32000,
}


def source_dir() -> Path:
    """The weightless model dir (config, tokenizer, forge_init.json), written under the cache."""
    from forge.functions.assets import default_cache_dir, embedded_model_source

    tiny = embedded_model_source()
    src = default_cache_dir() / "bench" / "llama-1024"
    config = json.dumps(CONFIG, indent=2)
    if not (src / "config.json").is_file() or (src / "config.json").read_text() != config:
        src.mkdir(parents=True, exist_ok=True)
        for f in tiny.iterdir():
            if f.is_file() and f.name not in ("config.json", "forge_init.json"):
                shutil.copy2(f, src / f.name)
        (src / "forge_init.json").write_text(json.dumps({"seed": SEED, "format": "safetensors"}))
        (src / "config.json").write_text(config)
    return src


def model_dir() -> Path:
    """A directory `from_pretrained` loads (weights made once, then cached)."""
    from forge.functions.assets import materialize_model

    return Path(materialize_model(source_dir()))


def flops_per_token(cfg: dict, position: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of one token at `position` (0-based, causal, keys 0..position),
    all layers, without the LM head: 2 FLOPs per weight; QK^T and AV 2 x 2 x heads x head_dim per key."""
    h, d = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    weights = h * d + 2 * h * kv + d * h + 3 * h * cfg["intermediate_size"]
    layers = cfg["num_hidden_layers"]
    return 2.0 * weights * layers, 4.0 * d * (position + 1) * layers


def attention_share(cfg: dict, spans: list[tuple[int, int]]) -> float:
    """Attention's share of the FLOPs of computing positions [start, end) of each sequence
    (attending to everything before them): a full sequence is (0, n); a suffix after a cached
    prefix of p tokens is (p, p + s)."""
    lin = att = 0.0
    for start, end in spans:
        n = end - start
        lin += flops_per_token(cfg, 0)[0] * n
        # sum over positions start..end-1 of (pos + 1)
        att += flops_per_token(cfg, 0)[1] * (end * (end + 1) - start * (start + 1)) / 2
    return att / (lin + att)


def flop_shares(spans: list[tuple[int, int]]) -> dict[str, float]:
    return {
        name: attention_share(cfg, spans)
        for name, cfg in (("llama-1024", CONFIG), ("tiny-llama (embedded)", TINY), ("Llama-2-7B", LLAMA2_7B))
    }


def parameters(cfg: dict = CONFIG) -> int:
    lin = flops_per_token(cfg, 0)[0] / 2
    return int(
        lin + 2 * cfg["vocab_size"] * cfg["hidden_size"] + (2 * cfg["num_hidden_layers"] + 1) * cfg["hidden_size"]
    )


def main(argv: list[str] | None = None) -> None:
    from benchmarks import harness

    harness.parser(__doc__, out=False).parse_args(argv)
    print(model_dir())
    print(f"{parameters():,} parameters")
    for n in (64, 256, 448, 1024, 2048):
        print(f"one sequence of {n}: " + ", ".join(f"{k} {v:.1%}" for k, v in flop_shares([(0, n)]).items()))


if __name__ == "__main__":
    main()
