"""What the block-diagonal mask of a tree batch costs attention (issue 20, item 6).

    python -m benchmarks.bench_tree_mask [--rows 17] [--context 448] [--choices 4] [--heads 4] [--head-dim 64]

A `score` tree row is one question: its context, then each choice's tokens, each seeing the
context and itself. SDPA runs it with a 4D mask, which computes every query x key pair. This
times that against the lower bounds a mask-free attention could reach: a plain causal attention
over the whole row, and the row split into the context's causal attention and the choices' rows
under their mask. Same inputs, best of 5, interleaved; not a test.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def best(f, reps: int = 5) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=17)
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--choice-tokens", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    P, c = a.context, a.choice_tokens
    S = P + a.choices * c
    q, k, v = (torch.randn(a.rows, a.heads, S, a.head_dim) for _ in range(3))
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(a.choices):  # each choice sees the context and its own tokens
        lo = P + i * c
        allowed[lo : lo + c, P:] = False
        allowed[lo : lo + c, lo : lo + c] = torch.ones(c, c, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, S, S).masked_fill_(~allowed, float("-inf"))

    def split() -> torch.Tensor:
        context = F.scaled_dot_product_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], is_causal=True)
        choices = F.scaled_dot_product_attention(q[:, :, P:], k, v, attn_mask=mask[:, :, P:])
        return torch.cat([context, choices], 2)

    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(split(), ref, atol=1e-5)
    rounds = {"4D mask (what runs)": [], "causal, no mask (a bound)": [], "context causal + choices masked": []}
    for _ in range(2):  # A B C C B A
        for name in (*rounds, *reversed(rounds)):
            f = {
                "4D mask (what runs)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                "causal, no mask (a bound)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "context causal + choices masked": split,
            }[name]
            rounds[name].append(best(f))
    print(f"rows {a.rows} x {S} ({P} context + {a.choices} x {c}), {a.heads} heads of {a.head_dim}")
    for name, ts in rounds.items():
        print(f"  {name:34s} {1e3 * min(ts):7.1f} - {1e3 * max(ts):7.1f} ms")


if __name__ == "__main__":
    main()
