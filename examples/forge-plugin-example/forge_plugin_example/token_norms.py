"""token_norms: per row, the L2 norms of the model's hidden states at one layer over its text's
tokens, given its prefix: their count, mean and largest, and every token's norm (ragged).

Written on Forge's public function API alone (`forge.api`). Rows that share a prefix run it once
per batch or take it from the prefix cache; the item view holds only the text's own tokens,
whatever the layout, so every batching mode gives the same numbers.
"""

from dataclasses import dataclass

from forge.api import CausalLMFunction, Field, Forward, ItemView, ModelFunctionConfig


@dataclass
class TokenNormsConfig(ModelFunctionConfig):
    """The root keys token_norms reads: the model's, the input's, and its layer."""

    layer: int = 4  # hidden-state index: 0 = input embeddings, 4 = the tiny Llama's final output


class TokenNorms(CausalLMFunction):
    name = "token_norms"
    config_schema = TokenNormsConfig
    fields = (
        Field("num_tokens", "int64"),
        Field("mean_norm", "float32"),
        Field("max_norm", "float32"),
        Field("norms", "float32", ragged=True),
    )

    def __init__(self, config: TokenNormsConfig):
        self.layer = config.layer
        self.forward = Forward(layers=(self.layer,))  # set before the base checks it against the model
        super().__init__(config)

    def options(self) -> dict:
        return {"layer": self.layer}

    def reduce(self, view: ItemView) -> dict:
        norms = view.hidden[self.layer].float().norm(dim=-1)  # one per text token, in order
        return {"num_tokens": norms.numel(), "mean_norm": norms.mean(), "max_norm": norms.max(), "norms": norms}
