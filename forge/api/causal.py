"""The model kinds' bases: `CausalLMFunction` (prefixes split off, cached and packed where that
is exact) and `EncoderFunction` (whole texts in rows or packed rows), on `forge.api.model`.
"""

from __future__ import annotations

from forge.api.model import ModelFunction, ModelFunctionConfig
from forge.batching.cost import CostModel
from forge.io.inputs import Column, Row
from forge.runtime.cost.models import check_layers
from forge.runtime.tokens.prompts import Prompt
from forge.vocab.geometry import Device


class CausalLMFunction(ModelFunction):
    """A function over a causal LM: prefixes split off, cached and packed where that is exact."""

    def __init__(self, config: ModelFunctionConfig):
        super().__init__(config)
        from forge.runtime.hooks.points import check_points
        from forge.runtime.model.capabilities import causal_lm_capabilities
        from forge.runtime.model.hf_compat import num_layers

        n = num_layers(self.config)
        check_layers(self.forward.layers, n)
        self.caps = causal_lm_capabilities(self.config, self.model, self.hf.source)
        ivs = self.interventions.items
        check_points(self.forward.capture, ivs, n, self.caps.attn, self.name, self.config, self.generates)
        self.interventions.check_widths(self.hidden_size, self.name)
        self.causal = self.caps.causal  # only a causal decoder may share a prefix's KV
        self.tree_rows = self.causal  # its runner lays out tree rows (forge.runtime.forward.tree_rows)
        self._mode = (True, False, True)  # (split_prefix, packed, prefix cache) until check_mode says

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = True) -> None:
        """Refuse, before any work, a layout that cannot equal a one-prompt forward pass."""
        self.caps.check(split_prefix, packed)
        self._mode = (split_prefix, packed, cache and split_prefix)

    def path(self) -> str:
        return self.caps.path(*self._mode)

    def worker_modules(self) -> list[str]:
        module = self.caps.model_module
        own = ["forge.runtime.forward.causal_lm", "forge.runtime.forward.views", *([module] if module else [])]
        return [*super().worker_modules(), *own]

    # -- memory -------------------------------------------------------------------------
    def extra_bytes_per_token(self) -> int:
        """Device bytes the function holds per token beyond the forward pass (default: none)."""
        return 0

    def memory_pooling(self) -> str:
        """What the measured forward pass keeps of each hidden state ("mean": every token, as float32)."""
        return "mean" if self.forward.layers else "last"

    def cost_model(self) -> CostModel:
        """The forward pass measured on fake tensors (cached; from the shape if that fails), plus
        per token: float32 logits when targets are scored, and the function's own extras."""
        from forge.runtime.cost.models import causal_lm_cost_model

        return causal_lm_cost_model(self)

    # -- running ------------------------------------------------------------------------
    def open_worker(self, device: Device, cache_tokens: int):
        from transformers import AutoModelForCausalLM

        from forge.runtime.forward.causal_lm import CausalLMRunner
        from forge.runtime.forward.views import CausalViews
        from forge.runtime.placement.dispatch import dispatch_for

        dispatch = dispatch_for(self, device)  # a group: read cut onto its devices (else: on the CPU, cut, moved)
        loader, attn = AutoModelForCausalLM, self.caps.attn
        model = dispatch.load(self.hf, loader, attn) if dispatch else self.hf.load(loader, "cpu", attn)
        runner = CausalLMRunner(
            model,
            device=None if dispatch else device.torch_device,
            layers=list(self.forward.layers),
            cache_tokens=cache_tokens,
            pad_token_id=self.hf.pad_token_id,
            caps=self.caps,
            allow_no_layers=True,
            stop_after_deepest=not self.forward.lm_head,  # the LM head reads the last layer's state
            captures=list(self.forward.capture),
            interventions=self.interventions,
        )
        return self._reducing_worker(CausalViews(runner, self.forward), dispatch)


class EncoderFunction(ModelFunction):
    """A function over a bidirectional encoder (BERT-style): whole texts, in rows or packed rows."""

    columns = {"text": Column(required=True), "id": Column(kinds=("string", "integer"))}
    causal = False

    def __init__(self, config: ModelFunctionConfig):
        super().__init__(config)
        from forge.runtime.forward.encoder import check_encoder, encoder_capabilities
        from forge.runtime.model.hf_compat import num_layers

        check_layers(self.forward.layers, num_layers(self.config))
        check_encoder(self.config, self.forward, self.name, self.model.name, bool(self.interventions))
        self.caps = encoder_capabilities(self.config, self.model.attn_implementation)
        self._mode = (False, False)  # (packed, prefix cache) until check_mode says

    def prompts(self, row: Row) -> list[Prompt] | str:
        return [Prompt(row.data["text"], None, row.data.get("label"))]

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = False) -> None:
        self.caps.check(packed, cache)
        self._mode = (packed, cache)

    def path(self) -> str:
        return self.caps.path(self._mode[0])

    def worker_modules(self) -> list[str]:
        return [*super().worker_modules(), "forge.runtime.forward.encoder", "forge.runtime.forward.views"]

    def cost_model(self) -> CostModel:
        from forge.runtime.cost.models import encoder_cost_model

        return encoder_cost_model(self)

    def open_worker(self, device: Device, cache_tokens: int):
        from transformers import AutoModel

        from forge.runtime.forward.encoder import EncoderViews
        from forge.runtime.placement.dispatch import dispatch_for

        dispatch = dispatch_for(self, device)  # a device group: read straight onto its devices, by the plan's map
        hf, attn = self.hf, self.caps.attn
        model = dispatch.load(hf, AutoModel, attn) if dispatch else hf.load(AutoModel, device.torch_device, attn)
        views = EncoderViews(model, self.caps, list(self.forward.layers), self.hf.pad_token_id)
        return self._reducing_worker(views, dispatch)
