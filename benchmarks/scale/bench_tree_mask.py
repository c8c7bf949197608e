"""What the block-diagonal mask of a tree batch costs attention (issue 20, item 6).

    python -m benchmarks tree-mask [--rows 17] [--context 448] [--choices 4] [--heads 4] [--head-dim 64] [--rounds 4]

A `score` tree row is one question: its context, then each choice's tokens, each seeing the
context and itself. SDPA runs it with a 4D mask, which computes every query x key pair. This
times that against the lower bounds a mask-free attention could reach: a plain causal attention
over the whole row, and the row split into the context's causal attention and the choices' rows
under their mask. Same inputs, each sample the best of 5, rounds interleaved (the harness); not a test.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks import harness


def best(f, reps: int = 5) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=4, threads=2, rows=(17, "rows of one question each"))
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--choice-tokens", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args(argv)
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
    forms = {
        "4D mask (what runs)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "causal, no mask (a bound)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "context causal + choices masked": split,
    }
    trials = harness.interleave({name: lambda r, f=f: best(f) for name, f in forms.items()}, a.rounds)
    rep = harness.Report(a)
    rep.text(f"rows {a.rows} x {S} ({P} context + {a.choices} x {c}), {a.heads} heads of {a.head_dim}", "")
    first = trials.names[0]
    lines = [
        [name, f"{1e3 * min(trials.values(name)):.1f} - {1e3 * max(trials.values(name)):.1f}"]
        + [f"{trials.ratio(name, first):.2f}"]
        for name in trials.names
    ]
    rep.table(["attention", "ms (best of 5, range over rounds)", "x 4D mask (medians)"], lines)
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
