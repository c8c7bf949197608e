"""logit_lens: per row, what each decoder layer would predict next, at every token of its text.

For each decoder layer L of `layers` (default: every layer) and each of the item's own tokens
(after its prefix; without one, every token), the model's final norm and LM head read the
residual stream out of layer L (``resid_post.L``, before the final norm for the last layer), and
float32 log_softmax gives the ``top_k`` most probable next tokens, most probable first:
``top_ids_<L>`` (int32 [tokens, k]) and ``top_logprobs_<L>`` (float32 [tokens, k]), beside the
text's ``token_ids`` (int32 [tokens]). At the last layer it is the model's own prediction.
Written as safetensors. Exact in every batching mode: rows sharing a prefix run it once, or take
it from the cache; the head is the worker's loaded model's own (no second copy).
"""

from dataclasses import dataclass, field

import torch

from forge import api
from forge.api import CausalLMFunction, Field, Forward, ItemView, ModelFunctionConfig

# per layer L, the fields top_<what>_<L>: what, its dtype, and its place in topk's (values, indices)
TOPS = (("ids", "int32", 1), ("logprobs", "float32", 0))


@dataclass
class LogitLensConfig(ModelFunctionConfig):
    """The root keys logit_lens reads: the model's, the input's, its layers and top_k."""

    # decoder layers L, read at resid_post.L (negative: from the last, named as given); []: every layer
    layers: list[int] = field(default_factory=list)
    top_k: int = api.positive(5)  # next tokens kept per token and layer, most probable first (at most the vocabulary)


class LogitLens(CausalLMFunction):
    name = "logit_lens"
    config_schema = LogitLensConfig
    format = "safetensors"

    def __init__(self, config: LogitLensConfig):
        # the points as given, which the base checks against the model; then every layer for layers=[]
        self.forward = Forward(capture=tuple(f"resid_post.{x}" for x in config.layers), head=True)
        super().__init__(config)
        self.layers = sorted(set(config.layers)) or list(range(self.config.get_text_config().num_hidden_layers))
        vocab = int(getattr(self.config.get_text_config(), "vocab_size", 0) or 0)
        if vocab and config.top_k > vocab:
            raise api.ForgeError(f"top_k={config.top_k} is more than the model's {vocab} tokens; give top_k <= {vocab}")
        self.forward = Forward(capture=tuple(f"resid_post.{x}" for x in self.layers), head=True)
        ragged = [Field(f"top_{w}_{x}", t, (config.top_k,), ragged=True) for x in self.layers for w, t, _ in TOPS]
        self.fields = (Field("token_ids", "int32", ragged=True), *ragged)

    def options(self) -> dict:
        return {"layers": self.layers, "top_k": self.cfg.top_k}

    def reduce(self, view: ItemView) -> dict:
        top = {x: view.head(view.captured[f"resid_post.{x}"]).log_softmax(-1).topk(self.cfg.top_k) for x in self.layers}
        out = {f"top_{w}_{x}": t[i] for x, t in top.items() for w, _, i in TOPS}
        return {"token_ids": torch.tensor(view.tokens[view.prefix_len :], dtype=torch.int32), **out}
