"""generate: text from a causal LM for each row, greedy or sampled, with continuous batching, and
optionally the activations of the generated tokens.

Rows: ``prompt`` (the text), optional ``prefix`` (a shared few-shot prefix: token rule as everywhere,
its KV pages shared between the prompts of a batch), ``id``, ``max_new_tokens`` (this row's limit)
and ``stop`` (a string or a list: the text ends before the first one found). Per row, Parquet:
``generated_ids`` (int32, ragged), ``text``, ``finish_reason`` (length | stop | eos),
``num_prompt_tokens`` and ``num_generated_tokens``; with ``layers`` / ``capture``, per generated
token (and, ``states_of: all``, per prompt token after the prefix first) the states from a plain
forward over the final sequence, as ragged float32 columns ``layer_<L>`` / ``<point>`` beside them.

Each batch Forge cuts runs in Forge's continuous-batching decoder (`forge.runtime.decode`): every
step holds at most the device's ``max_batch_tokens`` tokens (``budget.tokens_per_step`` by
default), one per running sequence plus a chunk of new prompts, whose shared prefix is computed
once per worker. An item's token geometry is its prompt plus its ``max_new_tokens``: the KV it may
hold, what batching=memory and ``max_seq_len`` see. Greedy output equals one-prompt-at-a-time
`generate` token for token, in every batching mode (tests/test_generate.py); ``sampling`` draws
each row's tokens from its own stream, seeded by (seed, id): a row's text does not depend on its
batch or the budget. A model whose cache is not keys and values per layer (`decoder_refusal`) is
refused before any work. ``intervene:`` entries apply at the prompt's, the prefix's and every
generated token's forward pass, by their span (``generated``: the tokens fed back).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from forge.api import CausalLMFunction, Column, Field, ForgeError, Forward, ModelFunctionConfig, Prompt, Row
from forge.config.checks import non_negative, share
from forge.config.schema import one_of, positive

FINISH = ("length", "stop", "eos")


@dataclass
class SamplingConfig:
    """How each token is chosen (forge.runtime.decode.Sampling): temperature 0 is greedy."""

    temperature: float = non_negative(0.0)  # 0: greedy; else softmax(logits / temperature)
    top_p: float = share(1.0)  # keep the most likely tokens up to this probability mass
    top_k: int = non_negative(0)  # keep the k most likely tokens (0: all)
    seed: int = 0  # with each row's id, seeds the row's own stream


@dataclass
class GenerateConfig(ModelFunctionConfig):
    """The root keys generate reads."""

    max_new_tokens: int = positive(32)  # tokens generated per row at most (a row's own max_new_tokens overrides it)
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these (a row's stop adds to them)
    eos: bool = True  # stop a row at the model's end-of-sequence token
    layers: list[int] = field(default_factory=list)  # hidden_states[L] of the generated tokens (0 = embeddings)
    capture: list[str] = field(default_factory=list)  # hook points kept for the generated tokens (as probe_gen's)
    states_of: str = one_of("generated", "generated", "all")  # all: the prompt's own tokens' states too
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy unless temperature > 0
    # a batch holds the KV of up to this many steps' tokens (prompts + max_new_tokens): the sequences
    # that decode together, sharing prefixes and steps; each step still takes at most the step budget
    batch_steps: int = positive(16)
    # sequences decoding at once at most (vLLM's max_num_seqs): the rest of a batch waits, and those
    # that finish are committed in parts of shard_size rows while the others decode (a kill keeps them)
    max_running: int = positive(256)
    shard_size: int = positive(64)  # rows per results shard, and per part a worker hands on as its rows finish


def decoder_refusal(config: Any, model_module: str | None = None) -> str | None:
    """Why Forge's decoder cannot run this model (None: it can): it places keys and values per layer
    in slots, so a cache holding anything else (a recurrent state, layers sharing KV, a cache class
    of the model's own, in `model_module`) is refused."""
    import importlib

    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        return f"its layers include {', '.join(map(str, other))}, not attention with keys and values per layer"
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build a cache for
        return f"transformers builds no cache for its config ({type(exc).__name__}: {exc})"
    layers = int(config.get_text_config().num_hidden_layers)
    plain = (DynamicLayer, DynamicSlidingWindowLayer)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) not in plain}
    if kinds:
        return f"its cache holds {', '.join(sorted(kinds))} (recurrent or shared state), not keys and values per layer"
    if cache.layers and len(cache.layers) != layers:
        return f"its cache has {len(cache.layers)} layers for {layers} decoder layers (layers share KV)"
    try:
        module = importlib.import_module(model_module) if model_module else None
    except ImportError:
        module = None
    found = vars(module).items() if module is not None else ()
    own = sorted(n for n, o in found if isinstance(o, type) and issubclass(o, Cache) and o.__module__ == model_module)
    if own:
        return f"its model code keeps its own cache ({', '.join(own)}), not keys and values per layer"
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
    tree_rows = False  # a batch is a set of prompts: the decoder lays out its own steps
    generates = True
    prefix_groups = False  # ... and shares their prefixes itself: batches mix them

    def __init__(self, config: GenerateConfig):
        self.forward = Forward(layers=tuple(config.layers), capture=tuple(config.capture))
        super().__init__(config)
        self.tree_rows = False  # CausalLMFunction.__init__ turns them on (for its runner's tree rows)
        if self.interventions and (config.layers or config.capture):
            raise ForgeError(
                "generate: intervene with layers or capture is not supported yet (the states' forward pass "
                "runs unsteered); drop layers/capture, or read the states with probe_gen on the generated text"
            )
        self.max_new, self.stop, self.eos = int(config.max_new_tokens), tuple(config.stop), bool(config.eos)
        self.states_of = config.states_of
        self.batch_steps = int(config.batch_steps)
        sampling = config.sampling
        self.sampling = (float(sampling.temperature), float(sampling.top_p), int(sampling.top_k), int(sampling.seed))
        self.states = bool(config.layers or config.capture)
        self.kv_model = None  # the KV memory model, once batching=memory asked for it: workers then keep to it
        names = [f"layer_{layer}" for layer in config.layers] + list(config.capture)
        self.fields = Generate.fields + tuple(Field(n, "float32", None, ragged=True) for n in names)

    def batch_device(self, device):
        """A batch's sequences hold their KV through its steps (batch_steps steps' tokens of it); each
        running one takes a token of every step, so the step budget bounds how many run at once. A
        batch pays the fixed cost of all its steps, and a shorter row costs only attention columns,
        not a padded forward slot: its overhead is what it may hold, so the packer does not cut
        batches at small length differences."""
        step, longest = device.limits.max_batch_tokens, device.limits.max_seq_len
        memory = device.memory_bytes  # what the KV model may fill: the budget less one step's activations
        if memory and decoder_refusal(self.config, self.caps.model_module) is None:  # else refused before work
            per_token = self.step_activation_bytes(1, longest)
            if self.kv_model is not None:  # smaller steps where a step would leave no room for one row's KV
                free = memory - self.kv_model.weight_bytes - self.least_kv_bytes(longest)
                step = max(1, min(step, int(free // per_token)))
            memory = max(1, memory - step * per_token)
        held = step * self.batch_steps
        limits = replace(device.limits, max_batch_tokens=held, max_rows=step)
        return replace(device, limits=limits, batch_overhead_tokens=held, memory_bytes=memory)

    def step_bytes(self, device) -> int:
        """What the KV model leaves out, for a device group's stages to keep room for: the activations
        of a step of one full-length row's tokens, and the KV the decoder holds to run one such row
        (`batch_device` then makes steps no larger than the room allows); 0 for a model the decoder
        refuses (it never runs)."""
        if decoder_refusal(self.config, self.caps.model_module) is not None:
            return 0
        longest = device.limits.max_seq_len
        return self.step_activation_bytes(longest, longest) + self.least_kv_bytes(longest)

    def least_kv_bytes(self, longest: int) -> int:
        """The KV budget the decoder needs for one sequence of `longest` tokens (0: no KV model yet)."""
        from forge.runtime.decode import least_kv_bytes
        from forge.runtime.hf_compat import num_layers, text_config

        if self.kv_model is None:
            return 0
        return least_kv_bytes(longest, self.kv_model.bytes_per_token, num_layers(text_config(self.config)))

    def step_activation_bytes(self, tokens: int, max_seq_len: int) -> int:
        """The most one engine step of `tokens` tokens holds beside weights and KV, from the model's
        shape (no measurement): every token's transients, its scores over at most max_seq_len keys,
        and a float32 row of logits for each (a decode step's rows)."""
        from forge.runtime.cost_models import shape_cost_model

        shape = shape_cost_model(self.config, self.model.torch_dtype)
        vocab = int(self.config.get_text_config().vocab_size)
        per_token = shape.bytes_per_token + max_seq_len * shape.bytes_per_score + 2 * 4 * vocab
        return int(tokens * per_token)

    def options(self) -> dict[str, Any]:
        states = {"layers": list(self.forward.layers), "capture": list(self.forward.capture)} if self.states else {}
        t, p, k, seed = self.sampling
        decoding = "greedy" if t == 0 else {"temperature": t, "top_p": p, "top_k": k, "seed": seed}
        return {
            "decoding": decoding,
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
        reason = decoder_refusal(self.config, self.caps.model_module)  # whatever the layout: first
        if reason:
            raise ForgeError(f"generate cannot run {self.caps.family}: {reason}")
        super().check_mode(split_prefix, packed, cache)  # the capture forward's layouts (rows of whole sequences)

    def path(self) -> str:
        how = "greedy" if self.sampling[0] == 0 else "sampled"
        return f"{self.caps.family}: continuous batching ({self.caps.attn} attention), {how}"

    def cost_model(self):
        """The KV memory model (batching=memory): a batch's sequences hold the KV of their tokens
        (prompt and max_new_tokens, the item's geometry) beside the weights, both as measured on the
        forward pass (`causal_lm_cost_model`); one step's activations, which do not grow with the
        batch, are taken off each device's budget (`batch_device`). Workers then hold their keys and
        values within the budget less the weights, preempting a sequence before going over."""
        from forge.batching.cost import CostModel
        from forge.runtime.cost_models import causal_lm_cost_model

        forward = causal_lm_cost_model(self)
        self.kv_model = CostModel(
            weight_bytes=forward.weight_bytes,
            bytes_per_token=forward.kv_bytes_per_token,
            bytes_per_score=0.0,
            kv_bytes_per_token=0.0,
            margin=forward.margin,
        )
        return self.kv_model

    def open_worker(self, device, cache_tokens: int):
        from transformers import AutoModelForCausalLM

        from forge.runtime.decode import Decoder
        from forge.runtime.dispatch import dispatch_for
        from forge.runtime.generate_worker import GenerateWorker
        from forge.runtime.sampling import Sampling

        dispatch = dispatch_for(self, device)  # a device group: read onto its devices by the plan's map
        loader, attn = AutoModelForCausalLM, self.caps.attn
        model = dispatch.load(self.hf, loader, attn) if dispatch else self.hf.load(loader, device.torch_device, attn)
        ids = model.generation_config.eos_token_id if self.eos else None
        eos = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        budget = device.limits.max_batch_tokens // self.batch_steps  # the step's, under batch_limits
        kv_bytes = None  # batching=memory: the device's budget less the weights and a step's activations
        if self.kv_model is not None and device.memory_bytes:
            kv_bytes = max(0, device.memory_bytes - self.kv_model.weight_bytes)
        sampling = Sampling(*self.sampling)
        steer = None
        if self.interventions:  # the prompt's, the prefix's and each generated token's forward pass, by span
            from forge.runtime.hf_compat import base_decoder, num_layers
            from forge.runtime.hooks import HookSet

            hooks = HookSet(model, base_decoder(model), num_layers(self.config), [], list(self.interventions.items))
            steer = (hooks, self.interventions.key)
        decoder = Decoder(
            model, self.tokenizer, budget, eos, self.hf.pad_token_id, sampling, kv_bytes=kv_bytes,
            max_running=int(self.cfg.max_running), steer=steer,
        )  # fmt: skip
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
        close = dispatch.close if dispatch else None
        return GenerateWorker(decoder, runner, self.states_of == "all", budget, close, int(self.cfg.shard_size))

    def open_sink(self, store):
        from forge.runtime.generate_worker import GenerateSink

        return GenerateSink(super().open_sink(store))
