"""Each `bench_peers` variant's outputs, read back for the comparison with the best peer's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def forge_scores(out: Path) -> dict:
    from forge.functions.score import load_scores

    return {(r["question"], r["choice"]): (r["loglik"], r["greedy"]) for r in load_scores(out).to_pylist()}


def peer_scores(out: Path) -> dict:
    return {(q, k): (ll, g) for q, k, ll, g in json.loads(out.read_text())["scores"]}


def accuracy(scores: dict, w: dict) -> tuple[float, float]:
    acc = norm = 0
    for q, gold in w["gold"].items():
        ll = np.array([scores[(q, k)][0] for k in range(len(w["choices"][q]))])
        lens = np.array([len(c.encode()) for c in w["choices"][q]], float)
        acc += int(np.argmax(ll) == gold)
        norm += int(np.argmax(ll / lens) == gold)
    return acc / len(w["gold"]), norm / len(w["gold"])


def forge_vectors(out: Path) -> dict:
    from forge.functions.activations import load_activations

    a = load_activations(out)
    return {layer: dict(zip(map(str, a.ids), t.numpy())) for layer, t in a.layers.items()}


def peer_vectors(out: Path) -> dict:
    z = np.load(out)
    ids = [str(x) for x in z["ids"]]
    return {int(k[6:]): dict(zip(ids, z[k])) for k in z.files if k.startswith("layer_")}


def forge_embeddings(out: Path) -> dict:
    from forge.functions.embed import load_embeddings

    e = load_embeddings(out)
    return {0: dict(zip(map(str, e.ids), np.asarray(e.vectors)))}


def peer_embeddings(out: Path) -> dict:
    z = np.load(out)
    return {0: dict(zip([str(x) for x in z["ids"]], z["vectors"]))}


def peer_version(out: Path) -> str:
    if out.suffix == ".json":
        return json.loads(out.read_text())["version"]
    return str(np.load(out)["version"])


def max_vec_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(a[layer][i] - b[layer][i]).max()) for layer in b for i in b[layer])


#: per function: Forge's outputs, a peer's, and the peer's output file's suffix
READERS = {
    "score": (forge_scores, peer_scores, ".json"),
    "probe_gen": (forge_vectors, peer_vectors, ".npz"),
    "embed": (forge_embeddings, peer_embeddings, ".npz"),
}


def difference(function: str, mine: dict, ref: dict, w: dict) -> str:
    """The largest output difference against the reference, as the table states it."""
    if function != "score":
        return f"{max_vec_diff(mine, ref):.1e}"
    diff = max(abs(mine[key][0] - ref[key][0]) for key in ref)
    acc = accuracy(mine, w)
    same = sum(mine[k][1] == ref[k][1] for k in ref)
    return f"{diff:.1e} (acc {acc[0]:.3f}, acc_norm {acc[1]:.3f}; greedy equal {same}/{len(ref)})"
