"""class_means: the mean last-token state per label over the whole dataset, and a steering direction.

A dataset-level result (`Aggregate`): each item's state at hidden-state index ``layer`` (its last
token; an item that is all prefix: its prefix's last) is folded into a float64 sum and count per
label, shard by shard, committed with the journal (kill -9 and resume fold each item exactly
once). `forge.io.results.aggregate(run)` gives ``mean`` and ``count`` ({label: value}) and, with
exactly two labels, ``direction``: mean[second] - mean[first] in sorted label order (a steering
vector for ``intervene:``, as ``vector: run:<run dir>#direction``). Items are journaled by id,
no per-item values are stored. Every row needs a ``label``: one without is a recorded row failure
(``failures.jsonl``, with its reason), never a class of its own.
"""

from dataclasses import dataclass

from forge.api import TEXT_COLUMNS, Aggregate, CausalLMFunction, Column, Forward, ItemView, ModelFunctionConfig


@dataclass
class ClassMeansConfig(ModelFunctionConfig):
    layer: int = -1  # hidden_states[layer] of the forward pass (0 = embeddings, -1 = the final normed output)


class ClassMeans(CausalLMFunction):
    name = "class_means"
    config_schema = ClassMeansConfig
    fields = (Aggregate("mean", "mean", by="label"), Aggregate("count", "count", by="label"))
    # a row without a label is a recorded row failure, never folded into a class of its own
    columns = {**TEXT_COLUMNS, "label": Column(required=True, kinds=("any",))}

    def __init__(self, config: ClassMeansConfig):
        self.layer = config.layer
        self.forward = Forward(layers=(config.layer,))
        super().__init__(config)

    def options(self) -> dict:
        return {"layer": self.layer}

    def reduce(self, view: ItemView) -> dict:
        return {"mean": view.last(self.layer), "count": 1}

    def finish(self, result: dict) -> dict:
        labels = sorted(result["mean"], key=str)
        return {"direction": result["mean"][labels[1]] - result["mean"][labels[0]]} if len(labels) == 2 else {}
