"""generate: text from a causal LM for each row, greedy, with continuous batching, and optionally
the activations of the generated tokens.

Rows: ``prompt`` (the text), optional ``prefix`` (a shared few-shot prefix: token rule as everywhere,
its KV pages shared between the prompts of a batch), ``id``, ``max_new_tokens`` (this row's limit)
and ``stop`` (a string or a list: the text ends before the first one found). Per row, Parquet:
``generated_ids`` (int32, ragged), ``text``, ``finish_reason`` (length | stop | eos),
``num_prompt_tokens`` and ``num_generated_tokens``; with ``layers`` / ``capture``, per generated
token (and, ``states_of: all``, per prompt token after the prefix first) the states from a plain
forward over the final sequence, as ragged float32 columns ``layer_<L>`` / ``<point>`` beside them.

Each batch Forge cuts runs in transformers' continuous-batching engine
(`forge.runtime.generation`): every engine step holds at most the device's ``max_batch_tokens``
query tokens (``budget.tokens_per_step`` by default), chunks of new prompts plus one token per
running sequence. An item's token geometry is its prompt plus its ``max_new_tokens``: the KV it may
hold, what batching=memory and ``max_seq_len`` see. Greedy output equals one-prompt-at-a-time
`generate` token for token, in every batching mode (tests/test_generate.py). A family whose model
code the engine cannot run (`engine_refusal`) is refused before any work, and so are interventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from forge.api import CausalLMFunction, Column, Field, ForgeError, Forward, ModelFunctionConfig, Prompt, Row
from forge.config.schema import one_of, positive

FINISH = ("length", "stop", "eos")


@dataclass
class GenerateConfig(ModelFunctionConfig):
    """The root keys generate reads."""

    max_new_tokens: int = positive(32)  # tokens generated per row at most (a row's own max_new_tokens overrides it)
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these (a row's stop adds to them)
    eos: bool = True  # stop a row at the model's end-of-sequence token
    layers: list[int] = field(default_factory=list)  # hidden_states[L] of the generated tokens (0 = embeddings)
    capture: list[str] = field(default_factory=list)  # hook points kept for the generated tokens (as probe_gen's)
    states_of: str = one_of("generated", "generated", "all")  # all: the prompt's own tokens' states too


# families whose model code breaks transformers' continuous-batching engine (transformers 5.x;
# tests/test_generate.py runs each and checks that it still does)
ENGINE_BREAKS = {
    "gpt_neox": "its attention calls the cache's update() without the engine's arguments",
    "opt": "its forward asks the cache for get_seq_length(), which the engine's paged cache lacks",
}


def engine_refusal(config: Any, caps: Any) -> str | None:
    """Why transformers' continuous-batching engine cannot run this model (None: it can, or its class
    cannot be read)."""
    from forge.runtime.class_facts import class_fact

    def attention_backend() -> bool | None:
        import importlib

        try:
            cls = getattr(importlib.import_module(caps.model_module), caps.model_class)
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        return bool(getattr(cls, "_supports_attention_backend", False))

    if caps.family in ENGINE_BREAKS:
        return ENGINE_BREAKS[caps.family]
    if getattr(config, "kv_lora_rank", None):
        return "multi-head latent attention (keys and values of different head sizes) does not fit its paged cache"
    if class_fact(config, "AutoModelForCausalLM", "attention_backend", attention_backend) is False:
        return "its attention does not go through transformers' attention interface, which the paged cache needs"
    return None


class Generate(CausalLMFunction):
    name = "generate"
    config_schema = GenerateConfig
    columns = {"prompt": Column(required=True), "prefix": Column(), "id": Column(kinds=("string", "integer"))}
    fields = (
        Field("generated_ids", "int32", (), ragged=True),
        Field("text", "string"),
        Field("finish_reason", "string"),
        Field("num_prompt_tokens", "int32"),
        Field("num_generated_tokens", "int32"),
    )
    tree_rows = False  # a batch is a set of prompts: the engine lays out its own steps

    def __init__(self, config: GenerateConfig):
        self.forward = Forward(layers=tuple(config.layers), capture=tuple(config.capture))
        super().__init__(config)
        self.tree_rows = False  # CausalLMFunction.__init__ turns them on (for its runner's tree rows)
        if self.interventions:
            raise ForgeError("generate does not apply interventions (intervene): the engine runs the plain model")
        self.max_new, self.stop, self.eos = int(config.max_new_tokens), tuple(config.stop), bool(config.eos)
        self.states_of = config.states_of
        self.states = bool(config.layers or config.capture)
        names = [f"layer_{layer}" for layer in config.layers] + list(config.capture)
        self.fields = Generate.fields + tuple(Field(n, "float32", None, ragged=True) for n in names)

    def options(self) -> dict[str, Any]:
        states = {"layers": list(self.forward.layers), "capture": list(self.forward.capture)} if self.states else {}
        return {
            "decoding": "greedy",
            "max_new_tokens": self.max_new,
            "stop": list(self.stop),
            "eos": self.eos,
            **states,
        }

    def prompts(self, row: Row) -> list[Prompt] | str:
        from forge.runtime.generation import RowLimits

        data = row.data
        limit = data.get("max_new_tokens")
        limit = self.max_new if limit is None else limit  # null: not given (a Parquet column other rows set)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            return f"'max_new_tokens' is {limit!r}; give a positive integer or leave it out"
        stop = data.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            return f"'stop' is {stop!r}; give a non-empty string or a list of them"
        limits = RowLimits(limit, (*self.stop, *stop))
        return [Prompt(data["prompt"], data.get("prefix") or None, data.get("label"), limits)]

    def records(self):
        """Items whose geometry is what they may hold: the prompt's tokens plus the row's max_new_tokens."""
        for record in super().records():
            limits = getattr(getattr(record, "meta", None), "data", None)
            yield record if limits is None else replace(record, num_tokens=record.num_tokens + limits.max_new_tokens)

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = True) -> None:
        reason = engine_refusal(self.config, self.caps)  # whatever the layout: first
        if reason:
            raise ForgeError(
                f"generate cannot run {self.caps.family} in transformers' continuous-batching engine: {reason}"
            )
        super().check_mode(split_prefix, packed, cache)  # the capture forward's layouts (rows of whole sequences)

    def path(self) -> str:
        return f"{self.caps.family}: continuous batching ({self.caps.attn} attention), greedy"

    def cost_model(self):
        from forge.runtime.cost_models import causal_lm_cost_model

        return causal_lm_cost_model(self, replace(self.forward, logits="targets"))  # the LM head runs every step

    def open_worker(self, device, cache_tokens: int):
        from transformers import AutoModelForCausalLM

        from forge.runtime.generate_worker import GenerateWorker
        from forge.runtime.generation import Engine

        model = self.hf.load(AutoModelForCausalLM, device.torch_device, self.caps.attn)
        engine = Engine(model, self.tokenizer, device.limits.max_batch_tokens, self.eos, self.hf.pad_token_id)
        runner = None
        if self.states:
            from forge.runtime.causal_lm import CausalLMRunner

            runner = CausalLMRunner(
                model,
                layers=list(self.forward.layers),
                pad_token_id=self.hf.pad_token_id,
                caps=self.caps,
                allow_no_layers=True,
                captures=list(self.forward.capture),
            )
        return GenerateWorker(engine, runner, self.states_of == "all", device.limits.max_batch_tokens)

    def open_sink(self, store):
        from forge.runtime.generate_worker import GenerateSink

        return GenerateSink(super().open_sink(store))
