"""Log-likelihoods of continuations: the LM head on only the positions that predict them.

Model: an item's token ids are the tokens the model *reads* (context + continuation minus its
last token); the continuation's n tokens are predicted by the last n of them. The batch runs
through `CausalLMRunner.forward_tokens` (any layout: rows, split prefix, prefix cache, packed),
which gives the base decoder's final hidden states; only the positions that predict a
continuation token are gathered, the LM head runs on those alone (in chunks), and float32
log_softmax gives each target's log-probability. Per item: the sum, the count, and whether
every target is the argmax (greedy). No full-vocabulary logits exist for context tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from forge.runtime.model.hf_compat import input_device, text_config
from forge.vocab.geometry import Batch

HEAD_CHUNK_TOKENS = 1024  # positions per LM-head call: bounds the [tokens, vocab] float32 block


@dataclass
class ScoreOutput:
    """What a score worker returns for a batch: plain numpy, so it crosses a process boundary."""

    loglik: Any  # float64 [n_items]: sum of the continuation's token log-probabilities, batch.items order
    num_tokens: Any  # int64 [n_items]: continuation tokens scored
    greedy: Any  # bool [n_items]: every continuation token is the argmax of its position
    prefix_computed_tokens: int  # prefix tokens run this batch (0 on a cache hit)
    cache_hit: bool


class LogitHead:
    """The model's own mapping from final hidden states to logits, applied to chosen positions.

    `lm_head` (the output embeddings), then what the family's forward applies after it:
    Gemma 2/3's final soft-capping, Granite's `logits_scaling`, Cohere's `logit_scale`.
    `verify` checks it against the model's full forward pass on a few tokens, so a family
    that does something else is refused with a clear error instead of scored wrongly.
    """

    def __init__(self, model: Any):
        self.model = model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head); score needs a causal LM")
        cfg = text_config(model.config)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.divide = getattr(cfg, "logits_scaling", None)  # Granite
        self.multiply = getattr(cfg, "logit_scale", None)  # Cohere

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.divide:
            logits = logits / self.divide
        if self.multiply:
            logits = logits * self.multiply
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def verify(self, base: Any, vocab: int, tol: float = 1e-3) -> None:
        """Raise ValueError unless head(base(ids).last_hidden_state) equals model(ids).logits."""
        ids = torch.arange(1, 7, device=input_device(self.model)).remainder(vocab).view(1, -1)
        with torch.inference_mode():
            want = self.model(input_ids=ids, use_cache=False).logits.float()
            got = self(base(input_ids=ids, use_cache=False).last_hidden_state).float().to(want.device)
        diff = (got - want).abs().max().item()
        scale = max(1.0, want.abs().max().item())
        if not diff <= tol * scale:
            raise ValueError(
                f"score: {type(self.model).__name__}'s logits are not its LM head on the final hidden states "
                f"(max difference {diff:.3g}); this family post-processes logits in a way score does not know"
            )


class ScoreRunner:
    """Scores batches of items whose `meta.targets` are their continuation token ids."""

    def __init__(self, runner: Any):
        self.runner = runner  # a CausalLMRunner on the loaded model
        self.head = LogitHead(runner.model)
        vocab = int(getattr(text_config(runner.config), "vocab_size", 8) or 8)
        self.head.verify(runner.base, vocab)

    def run(self, batch: Batch) -> ScoreOutput:
        items = batch.items
        n = len(items)
        targets_list = [list(item.meta.targets) for item in items]
        counts = torch.tensor([len(t) for t in targets_list], dtype=torch.long)
        with torch.inference_mode():
            states = self.runner.forward_tokens(batch)
            if states is None or states.total == 0:
                return ScoreOutput(np.zeros(n), counts.numpy(), np.zeros(n, bool), 0, False)
            for item, want, have in zip(items, counts.tolist(), states.lens.tolist()):
                if not 0 < want <= have:
                    raise ValueError(f"item {item.id!r}: {want} continuation tokens but {have} tokens in its row")
            tok_item, tok_within, tok_row, tok_col = states.tok
            # the last `count` tokens of each item's span predict its continuation
            scored = tok_within >= (states.lens - counts)[tok_item]
            rows, cols, owner = tok_row[scored], tok_col[scored], tok_item[scored]
            targets = torch.tensor([t for ts in targets_list for t in ts], dtype=torch.long)
            dev = states.last.device  # the final norm's device (a split model's LM head may sit on another)
            logprob = torch.empty(targets.numel(), dtype=torch.float32)
            argmax_ok = torch.empty(targets.numel(), dtype=torch.bool)
            for lo in range(0, targets.numel(), HEAD_CHUNK_TOKENS):
                hi = min(lo + HEAD_CHUNK_TOKENS, targets.numel())
                h = states.last[rows[lo:hi].to(dev), cols[lo:hi].to(dev)]
                logp = torch.log_softmax(self.head(h).float(), dim=-1)
                tgt = targets[lo:hi].to(logp.device)
                logprob[lo:hi] = logp.gather(1, tgt[:, None])[:, 0].cpu()
                argmax_ok[lo:hi] = (logp.argmax(dim=-1) == tgt).cpu()
        loglik = torch.zeros(n, dtype=torch.float64).index_add_(0, owner, logprob.double())
        misses = torch.zeros(n, dtype=torch.long).index_add_(0, owner, (~argmax_ok).long())
        return ScoreOutput(
            loglik.numpy(), counts.numpy(), (misses == 0).numpy(), states.prefix_computed_tokens, states.cache_hit
        )

    def close(self) -> None:
        self.runner = None


NORM_NAMES = ("norm", "final_layer_norm", "ln_f", "final_layernorm", "norm_f", "final_norm")


class StateHead:
    """`ItemView.head`: the model's final norm, then its LM head (`LogitHead`), on any states.

    The final norm is the decoder's module that turns its last layer's output into its
    `last_hidden_state` (found by name, then checked on a few tokens: norm(input) must equal the
    decoder's output), so ``head(view.captured["resid_post.L"])`` is the logit lens at layer L."""

    def __init__(self, model: Any, base: Any):
        self.logits = LogitHead(model)
        self.base = base
        self.norm: Any = None
        self.project = getattr(base, "project_out", None)  # OPT: a projection after the norm

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab] of states [..., hidden] (the model's dtype, or any float)."""
        if self.norm is None:
            self.norm = self._find_norm()
        dtype = next(self.base.parameters()).dtype
        h = self.norm(states.to(dtype))
        if self.project is not None:
            h = self.project(h)
        return self.logits(h).float()

    def _find_norm(self) -> Any:
        for name in NORM_NAMES:
            norm = getattr(self.base, name, None)
            if isinstance(norm, torch.nn.Module) and self._checks(norm):
                return norm
        raise ValueError(
            f"view.head: cannot tell {type(self.base).__name__}'s final norm (none of {', '.join(NORM_NAMES)} "
            "maps its last layer's output to its output); read view.hidden at the last index instead"
        )

    def _checks(self, norm: Any) -> bool:
        seen: list[torch.Tensor] = []
        handle = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        vocab = int(getattr(text_config(self.base.config), "vocab_size", 8) or 8)
        ids = torch.arange(1, 7, device=input_device(self.base)).remainder(vocab).view(1, -1)
        try:
            with torch.inference_mode():
                out = self.base(input_ids=ids, use_cache=False).last_hidden_state
                if len(seen) != 1:
                    return False
                got = norm(seen[0])
                got = self.project(got) if self.project is not None else got
        finally:
            handle.remove()
        return got.shape == out.shape and bool(torch.allclose(got.float(), out.float(), rtol=1e-4, atol=1e-5))
