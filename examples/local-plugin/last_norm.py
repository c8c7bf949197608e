"""A function in a local module, no package: `plugins=[last_norm]` on the command line, or the
class handed to `forge.run`. Its `config_schema` holds its one default (no YAML restates it).
The recipe in docs/functions.md ("Develop a plugin without installing it") shows this file."""

from dataclasses import dataclass

import forge
from forge.api import CausalLMFunction, Field, Forward, ModelFunctionConfig


@dataclass
class LastNormConfig(ModelFunctionConfig):
    layer: int = 2  # the hidden state whose last token's norm is written


class LastNorm(CausalLMFunction):
    name = "last_norm"
    config_schema = LastNormConfig
    fields = (Field("norm", "float32"),)

    def __init__(self, config: LastNormConfig):
        self.layer = config.layer
        self.forward = Forward(layers=(self.layer,))
        super().__init__(config)

    def options(self) -> dict:
        return {"layer": self.layer}

    def reduce(self, view) -> dict:
        return {"norm": view.hidden[self.layer][-1].float().norm()}


@forge.hookimpl
def forge_functions():
    return {"last_norm": LastNorm}
