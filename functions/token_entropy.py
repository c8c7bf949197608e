"""token_entropy: per row, how uncertain a causal LM is about the next token, at every token of its text.

For each of the item's own tokens (after its prefix; without one, every token), ``entropy``: the
entropy (nats, float32) of the model's full next-token distribution after that token (a float32
softmax over the whole vocabulary; -sum p log p), ragged [tokens]; and ``mean_entropy`` (float64),
their mean. Written as Parquet. Exact in every batching mode: rows sharing a prefix run it once, or
take it from the cache.
"""

import torch

from forge.api import CausalLMFunction, Field, Forward, ItemView


class TokenEntropy(CausalLMFunction):
    name = "token_entropy"
    fields = (Field("mean_entropy", "float64"), Field("entropy", "float32", ragged=True))
    forward = Forward(logits="all")  # float32 logits at every own token; no hidden states

    def reduce(self, view: ItemView) -> dict:
        entropy = torch.special.entr(torch.softmax(view.logits, dim=-1)).sum(dim=-1)  # -p log p; 0 where p = 0
        return {"mean_entropy": entropy.double().mean(), "entropy": entropy}
