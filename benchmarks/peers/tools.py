"""The real peers, each run as its own process the way a user runs it (issue 20, item 5).

    python -m benchmarks.peers.tools lm-eval --rows MC.jsonl --model DIR --batch-size 32 --out OUT.json
    python -m benchmarks.peers.tools nnsight --rows ROWS.jsonl --model DIR --order length --layers 1,2,4 --out OUT.npz
    python -m benchmarks.peers.tools transformer-lens --rows ROWS.jsonl --model DIR --layers 1,2,4 --out OUT.npz
    python -m benchmarks.peers.tools sentence-transformers --rows TEXTS.jsonl --model DIR --out OUT.npz
    python -m benchmarks.peers.tools nnsight-states --rows ROWS.jsonl --model DIR --layers 2 --out DIR
    python -m benchmarks.peers.tools saelens --rows ROWS.jsonl --model DIR --layers 2 --out DIR

`benchmarks/peers/bench_peers.py` (the first four) and `benchmarks/peers/bench_token_states.py`
(the last two) time each as a subprocess from its start to its exit (imports, model load,
tokenizing and the work included), 2 torch threads, float32, CPU. Each writes its outputs for
the comparison with Forge's. Needs the `bench` extra (`pip install -e '.[bench]'`), or for the
last two `bench-token-states`; never imported by the tests. Nothing of Forge or the benchmarks
is imported here: a peer's process pays for its own tool alone, as a user's script would.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def probe_tokens(tok, rows: list[dict]) -> list[list[int]]:
    """Forge's token rule (forge/runtime/tokens/token_rule.py): the prefix alone with the special tokens, the
    text after it without them; a text without a prefix with them."""
    out = []
    for r in rows:
        if r.get("prefix"):
            out.append(
                list(tok(r["prefix"])["input_ids"]) + list(tok(r["text"], add_special_tokens=False)["input_ids"])
            )
        else:
            out.append(list(tok(r["text"])["input_ids"]))
    return out


def batches(tokens: list[list[int]], order: str, size: int) -> list[list[int]]:
    idx = list(range(len(tokens)))
    if order == "length":
        idx.sort(key=lambda i: -len(tokens[i]))
    return [idx[lo : lo + size] for lo in range(0, len(idx), size)]


def pad(tokens: list[list[int]], pad_id: int):
    import torch

    width = max(len(t) for t in tokens)
    ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for r, t in enumerate(tokens):
        ids[r, : len(t)] = torch.tensor(t)
        mask[r, : len(t)] = 1
    return ids, mask


def run_lm_eval(a) -> dict:
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=a.model, device="cpu", dtype="float32", batch_size=a.batch_size)
    rows = read_rows(a.rows)
    keys, reqs = [], []
    for r in rows:
        for k, c in enumerate(r["choices"]):
            keys.append((str(r["id"]), k))
            reqs.append(Instance(request_type="loglikelihood", doc=r, arguments=(r["context"], " " + c), idx=k))
    res = lm.loglikelihood(reqs, disable_tqdm=True)
    return {
        "version": lm_eval.__version__,
        "scores": [[q, k, float(ll), bool(g)] for (q, k), (ll, g) in zip(keys, res)],
    }


def run_nnsight(a) -> dict:
    import nnsight
    import numpy as np
    import torch
    from nnsight import LanguageModel

    layers = [int(x) for x in a.layers.split(",")]
    lm = LanguageModel(a.model, dispatch=True, dtype=torch.float32, device_map="cpu")
    tok = lm.tokenizer
    rows = read_rows(a.rows)
    tokens = probe_tokens(tok, rows)
    n_layers = lm.config.num_hidden_layers
    out = {layer: [None] * len(rows) for layer in layers}
    with torch.no_grad():
        for idx in batches(tokens, a.order, a.batch_size):
            ids, mask = pad([tokens[i] for i in idx], tok.pad_token_id)
            last = mask.sum(1) - 1
            rr = torch.arange(len(idx))
            saved = {}
            with lm.trace({"input_ids": ids, "attention_mask": mask}):
                for layer in layers:
                    # hidden_states[L]: layer L-1's output; the last one after the final norm (as HF's)
                    module = lm.model.norm if layer == n_layers else lm.model.layers[layer - 1]
                    saved[layer] = module.output[rr, last].save()
            for layer in layers:
                v = saved[layer]
                v = getattr(v, "value", v)
                for j, i in enumerate(idx):
                    out[layer][i] = v[j].float().numpy()
    return {
        "version": nnsight.__version__,
        "ids": [str(r["id"]) for r in rows],
        **{f"layer_{layer}": np.stack(vs) for layer, vs in out.items()},
    }


def run_transformer_lens(a) -> dict:
    """`run_with_cache`: TransformerLens 4 loads a local Hugging Face model through
    `TransformerBridge.boot_transformers` (its `HookedTransformer` was removed in 4.0); raw HF
    weights, eager attention (the bridge forces it so hooks see the scores)."""
    import importlib.metadata

    import numpy as np
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    layers = [int(x) for x in a.layers.split(",")]
    tok = AutoTokenizer.from_pretrained(a.model)
    model = TransformerBridge.boot_transformers(a.model, device="cpu", dtype=torch.float32, tokenizer=tok)
    rows = read_rows(a.rows)
    tokens = probe_tokens(tok, rows)
    n_layers = model.cfg.n_layers
    names = [f"blocks.{layer - 1}.hook_resid_post" if layer < n_layers else "ln_final.hook_out" for layer in layers]
    out = {layer: [None] * len(rows) for layer in layers}
    with torch.no_grad():
        for idx in batches(tokens, a.order, a.batch_size):
            ids, mask = pad([tokens[i] for i in idx], tok.pad_token_id)
            _, cache = model.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: n in names)
            last = mask.sum(1) - 1
            for layer, name in zip(layers, names):
                v = cache[name][torch.arange(len(idx)), last]
                for j, i in enumerate(idx):
                    out[layer][i] = v[j].float().numpy()
    return {
        "version": importlib.metadata.version("transformer-lens"),
        "ids": [str(r["id"]) for r in rows],
        **{f"layer_{layer}": np.stack(vs) for layer, vs in out.items()},
    }


def run_nnsight_states(a) -> None:
    """The user's loop for every token's states: nnsight traces of 32 right-padded rows in arrival
    order, saving the layer's states; each row's own tokens kept, each prefix's states once;
    safetensors files in the `--out` folder."""
    import torch
    import transformers
    from nnsight import LanguageModel
    from safetensors.torch import save_file

    layer = int(a.layers)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    lm = LanguageModel(
        transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval(), tokenizer=tok
    )
    rows = read_rows(a.rows)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    seen: set[str] = set()
    own: list[torch.Tensor] = []
    prefixes: list[torch.Tensor] = []
    for lo in range(0, len(rows), a.batch_size):
        batch = rows[lo : lo + a.batch_size]
        seqs = probe_tokens(tok, batch)
        plens = [len(tok(r["prefix"])["input_ids"]) if r.get("prefix") else 0 for r in batch]
        ids, mask = pad(seqs, pad_id)
        with torch.no_grad():
            with lm.trace({"input_ids": ids, "attention_mask": mask}):
                output = lm.model.layers[layer - 1].output
                states = (output[0] if isinstance(output, tuple) else output).save()
        for r, s, p, h in zip(batch, seqs, plens, states):
            own.append(h[p : len(s)].clone())
            if p and r["prefix"] not in seen:
                seen.add(r["prefix"])
                prefixes.append(h[:p].clone())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, parts in (("activations", own), ("prefix_states", prefixes)):
        offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(x) for x in parts]), 0).tolist()])
        save_file(
            {f"layer_{layer}": torch.cat(parts), f"layer_{layer}.offsets": offsets}, str(out / f"{name}.safetensors")
        )


def run_saelens(a) -> None:
    """SAELens's activation cache runner on the same model and texts (prefix + statement)."""
    import transformers
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    layer, out = int(a.layers), Path(a.out)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    texts = [(r.get("prefix") or "") + r["text"] for r in read_rows(a.rows)]
    tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    data = out.parent / f"{out.name}-dataset"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    context = 256
    cfg = CacheActivationsRunnerConfig(
        dataset_path=str(data),
        model_name=str(a.model),
        model_class_name="AutoModelForCausalLM",
        hook_name=f"model.layers.{layer - 1}",
        d_in=int(transformers.AutoConfig.from_pretrained(a.model).hidden_size),
        training_tokens=tokens // context * context,
        context_size=context,
        model_batch_size=a.batch_size,
        new_cached_activations_path=str(out),
        device="cpu",
        buffer_size_gb=0.25,
        shuffle=False,
        streaming=False,
    )
    CacheActivationsRunner(cfg).run()


def run_sentence_transformers(a) -> dict:
    import numpy as np
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(a.model, device="cpu")
    rows = read_rows(a.rows)
    vecs = model.encode(
        [r["text"] for r in rows], batch_size=a.batch_size, convert_to_numpy=True, normalize_embeddings=True
    )
    return {
        "version": sentence_transformers.__version__,
        "ids": [str(r["id"]) for r in rows],
        "vectors": np.asarray(vecs, np.float32),
    }


TOOLS = {
    "lm-eval": run_lm_eval,
    "nnsight": run_nnsight,
    "transformer-lens": run_transformer_lens,
    "sentence-transformers": run_sentence_transformers,
    "nnsight-states": run_nnsight_states,
    "saelens": run_saelens,
}


def main(argv: list[str] | None = None) -> None:
    # a peer program's own command line, not a benchmark's: it imports nothing of the benchmarks
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers.tools", description=__doc__.splitlines()[0])
    ap.add_argument("tool", choices=sorted(TOOLS))
    ap.add_argument("--rows", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", default="32")
    ap.add_argument("--order", default="length", choices=("length", "arrival"))
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.batch_size != "auto":
        a.batch_size = int(a.batch_size)
    elif a.tool != "lm-eval":
        sys.exit("--batch-size auto is lm-eval's only")
    res = TOOLS[a.tool](a)
    if res is None:  # the tool wrote its own files
        return
    if a.out.endswith(".json"):
        Path(a.out).write_text(json.dumps(res))
    else:
        import numpy as np

        np.savez(a.out, **{k: np.asarray(v) for k, v in res.items()})


if __name__ == "__main__":
    main()
