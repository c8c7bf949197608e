"""surprisal: per row, how surprising its text is to a causal LM, given its prefix.

For each row: ``sum_nll``, the negative log-likelihood (nats) of the text's tokens, each given
every token before it (the prefix included); ``num_tokens``, how many were scored (without a
prefix, every token after the first); ``mean_nll`` = sum_nll / num_tokens. Written as Parquet.
Exact in every batching mode: rows sharing a prefix run it once, or take it from the cache.
"""

from forge.api import CausalLMFunction, Field, Forward, ItemView


class Surprisal(CausalLMFunction):
    name = "surprisal"
    fields = (Field("mean_nll", "float64"), Field("sum_nll", "float64"), Field("num_tokens", "int64"))
    forward = Forward(targets=True)  # log-probabilities of the text's tokens; no hidden states

    def reduce(self, view: ItemView) -> dict:
        nll = -view.logprobs.double()
        return {"mean_nll": nll.mean(), "sum_nll": nll.sum(), "num_tokens": nll.numel()}
