"""`GenerativeFunction`: a causal LM's function whose items are prompts that Forge's decoder
continues (forge.runtime.decoder.engine), steered by ``intervene:`` where the config has it.

An author declares the config (a `GenerativeConfig` subclass), the fields, and `prompts(row)`:
each `Prompt` carries its own `RowLimits` (`self.row_limits(row)` reads a row's ``max_new_tokens``
and ``stop`` over the config's). The base does the rest, once for every generative function:
- an item's token geometry is its prompt plus its ``max_new_tokens`` (the KV it may hold);
- a batch holds ``batch_steps`` steps' tokens of KV, each step at most the step budget
  (`batch_device`), and under batching=memory the KV model prices it (`cost_model`);
- a model whose cache is not keys and values per layer is refused before work (`check_mode`);
- the worker (forge.runtime.decoder.worker) generates a batch and hands finished rows on in
  parts of ``shard_size``, with the function's own fields of each (`finished(text, label)`); with
  ``layers``/``capture`` in `forward`, it adds the generated tokens' states from a plain forward
  over each final sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from forge.api.causal import CausalLMFunction
from forge.api.model import ModelFunctionConfig
from forge.config.checks import non_negative, positive, share
from forge.errors import ForgeError
from forge.io.inputs import Row
from forge.runtime.decoder.finish import RowLimits
from forge.vocab.geometry import Item, StepBudget

__all__ = ["GenerativeConfig", "GenerativeFunction", "RowLimits", "SamplingConfig"]


@dataclass
class SamplingConfig:
    """How each token is chosen (forge.runtime.decoder.sampling.Sampling): temperature 0 is greedy."""

    temperature: float = non_negative(0.0)  # 0: greedy; else softmax(logits / temperature)
    top_p: float = share(1.0)  # keep the most likely tokens up to this probability mass
    top_k: int = non_negative(0)  # keep the k most likely tokens (0: all)
    seed: int = non_negative(0)  # with each row's id, seeds the row's own stream (0 or more)


@dataclass
class GenerativeConfig(ModelFunctionConfig):
    """The root keys every generative function reads."""

    max_new_tokens: int = positive(32)  # tokens generated per row at most (a row's own max_new_tokens overrides it)
    stop: list[str] = field(default_factory=list)  # the text ends before the first of these (a row's stop adds to them)
    eos: bool = True  # stop a row at the model's end-of-sequence token
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy unless temperature > 0
    # a batch holds the KV of up to this many steps' tokens (prompts + max_new_tokens): the sequences
    # that decode together, sharing prefixes and steps; each step still takes at most the step budget
    batch_steps: int = positive(16)
    # sequences decoding at once at most (vLLM's max_num_seqs): the rest of a batch waits, and those
    # that finish are committed in parts of shard_size rows while the others decode (a kill keeps them)
    max_running: int = positive(256)
    shard_size: int = positive(64)  # rows per results shard, and per part a worker hands on as its rows finish


class GenerativeFunction(CausalLMFunction):
    """Prompts continued by Forge's continuous-batching decoder; see the module's docstring."""

    config_schema: type[GenerativeConfig] = GenerativeConfig
    generates = True
    prefix_groups = False  # the decoder shares prefixes itself: batches mix them
    states_of_prompt = False  # the states (forward.layers/capture) of the prompt's own tokens too

    def __init__(self, config: GenerativeConfig):
        super().__init__(config)
        self.tree_rows = False  # a batch is a set of prompts: the decoder lays out its own steps
        self.states = bool(self.forward.layers or self.forward.capture)
        if self.interventions and self.states:
            raise ForgeError(
                f"{self.name}: intervene with layers or capture is not supported yet (the states' forward pass "
                "runs unsteered); drop layers/capture, or read the states with probe_gen on the generated text"
            )
        negative = [iv.span for iv in self.interventions.items if isinstance(iv.span, tuple) and min(iv.span) < 0]
        if negative:  # positions from the end: of a sequence whose end is not known until it is generated
            raise ForgeError(
                f"{self.name}: intervene span {list(negative[0])} counts from the end, which a generation has not "
                "reached; use span: last (the prompt's last token), generated, or positions from 0"
            )
        if any(iv.op == "patch" and iv.span == "generated" for iv in self.interventions.items):
            raise ForgeError(
                f"{self.name}: intervene op: patch with span: generated has nothing to patch from (a source row is "
                "its prompt, with no generated tokens); patch the prompt's positions (span: last, text or a list)"
            )
        self.max_new, self.stop, self.eos = int(config.max_new_tokens), tuple(config.stop), bool(config.eos)
        self.batch_steps = int(config.batch_steps)
        self.max_running = int(config.max_running)  # sequences a worker decodes at once
        sampling = config.sampling
        self.sampling = (float(sampling.temperature), float(sampling.top_p), int(sampling.top_k), int(sampling.seed))
        self.kv_model: Any = None  # the KV memory model, once batching=memory asked for it: workers then keep to it

    def row_limits(self, row: Row) -> RowLimits | str:
        """A row's own limits: its ``max_new_tokens`` and ``stop`` over the config's (a string: why not)."""
        limit = row.data.get("max_new_tokens")
        limit = self.max_new if limit is None else limit  # null: not given (a Parquet column other rows set)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            return f"'max_new_tokens' is {limit!r}; give a positive integer or leave it out"
        stop = row.data.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            return f"'stop' is {stop!r}; give a non-empty string or a list of them"
        return RowLimits(limit, (*self.stop, *stop))

    def options(self) -> dict[str, Any]:
        t, p, k, seed = self.sampling
        decoding = "greedy" if t == 0 else {"temperature": t, "top_p": p, "top_k": k, "seed": seed}
        return {"decoding": decoding, "max_new_tokens": self.max_new, "stop": list(self.stop), "eos": self.eos}

    def records(self):
        """Items whose geometry is what they may hold: the prompt's tokens plus the row's max_new_tokens."""
        for record in super().records():
            limits = getattr(getattr(record, "meta", None), "data", None)
            if limits is None or not isinstance(record, Item):
                yield record
            else:
                yield replace(record, num_tokens=record.num_tokens + limits.max_new_tokens)

    def check_mode(self, split_prefix: bool, packed: bool, cache: bool = True) -> None:
        from forge.runtime.decoder.fit import decoder_refusal

        reason = decoder_refusal(self.config, self.caps.model_module)  # whatever the layout: first
        if reason:
            raise ForgeError(f"{self.name} cannot run {self.caps.family}: {reason}")
        super().check_mode(split_prefix, packed, cache)  # the states' forward layouts (rows of whole sequences)

    def path(self) -> str:
        how = "greedy" if self.sampling[0] == 0 else "sampled"
        return f"{self.caps.family}: continuous batching ({self.caps.attn} attention), {how}"

    # -- memory ---------------------------------------------------------------------------
    def batch_device(self, device):
        """A batch's sequences hold their KV through its steps (batch_steps steps' tokens of it); each
        running one takes a token of every step, so the step budget bounds how many run at once. A
        batch pays the fixed cost of all its steps, and a shorter row costs only attention columns,
        not a padded forward slot: its overhead is what it may hold, so the packer does not cut
        batches at small length differences."""
        from forge.runtime.decoder.fit import decoder_refusal

        step, longest = device.steps().tokens, device.limits.max_seq_len
        memory = device.memory_bytes  # what the KV model may fill: the budget less one step's activations
        if memory and decoder_refusal(self.config, self.caps.model_module) is None:  # else refused before work
            per_token = self.step_activation_bytes(1, longest)
            if self.kv_model is not None:  # smaller steps where a step would leave no room for one row's KV
                free = memory - self.kv_model.weight_bytes - self.least_kv_bytes(longest)
                step = max(1, min(step, int(free // per_token)))
            memory = max(1, memory - step * per_token)
        held = step * self.batch_steps
        limits = replace(device.limits, max_batch_tokens=held, max_rows=step)
        budget = StepBudget(step, engine=True)  # the decoder keeps each step within it; the ledger checks
        return replace(device, limits=limits, batch_overhead_tokens=held, memory_bytes=memory, step_budget=budget)

    def step_bytes(self, device) -> int:
        """What the KV model leaves out, for a device group's stages to keep room for: the activations
        of a step of one full-length row's tokens, and the KV the decoder holds to run one such row
        (`batch_device` then makes steps no larger than the room allows); 0 for a model the decoder
        refuses (it never runs)."""
        from forge.runtime.decoder.fit import decoder_refusal

        if decoder_refusal(self.config, self.caps.model_module) is not None:
            return 0
        longest = device.limits.max_seq_len
        return self.step_activation_bytes(longest, longest) + self.least_kv_bytes(longest)

    def planned_peak_bytes(self, batch, device, stored_prefix_tokens: int = 0) -> int:
        """An upper bound of what the decoder holds running `batch`: the weights; the keys and values
        of each prefix once (the batch's and `stored_prefix_tokens` kept from earlier ones) and of the
        `max_running` longest sequences at their full length (prompt and max_new_tokens: the item's
        geometry); and the larger of two steps' activations over the batch's longest sequence
        (`step_activation_bytes`): a prefill step as large as the step budget allows (a logit row a
        prompt), or a decode step of every running sequence. A sum of maxima: the largest step and
        the most keys and values held come at different moments, so a run stays under it."""
        import heapq

        from forge.runtime.decoder.prefill import PREFIX_TOKENS  # the most a worker's prefix store keeps

        kv = self.kv_model if self.kv_model is not None else self.cost_model()
        items = batch.items
        prefixes = {it.prefix_key: it.prefix_len for it in items if it.prefix_len}
        running = heapq.nlargest(self.max_running, (it.num_tokens - it.prefix_len for it in items))
        held = min(stored_prefix_tokens, PREFIX_TOKENS) + sum(prefixes.values()) + sum(running)
        longest = max((it.num_tokens for it in items), default=0)
        step = min(device.steps().tokens, sum(it.num_tokens for it in items))
        prefill = self.step_activation_bytes(step, longest, logit_rows=min(step, len(items)))  # a logit row a prompt
        decode = self.step_activation_bytes(min(len(running), step), longest)  # a token and its logits a sequence
        return int(kv.weight_bytes + held * kv.bytes_per_token + max(prefill, decode))

    def least_kv_bytes(self, longest: int) -> int:
        """The KV budget the decoder needs for one sequence of `longest` tokens (0: no KV model yet)."""
        from forge.runtime.decoder.sequence import least_kv_bytes
        from forge.runtime.model.hf_compat import num_layers, text_config

        if self.kv_model is None:
            return 0
        return least_kv_bytes(longest, self.kv_model.bytes_per_token, num_layers(text_config(self.config)))

    def step_activation_bytes(self, tokens: int, max_seq_len: int, logit_rows: int | None = None) -> int:
        from forge.runtime.decoder.fit import step_activation_bytes

        return step_activation_bytes(self.config, self.model.torch_dtype, tokens, max_seq_len, logit_rows)

    def cost_model(self):
        """The KV memory model (batching=memory): a batch's sequences hold the KV of their tokens
        (prompt and max_new_tokens, the item's geometry) beside the weights, both as measured on the
        forward pass (`causal_lm_cost_model`); one step's activations, which do not grow with the
        batch, are taken off each device's budget (`batch_device`). Workers then hold their keys and
        values within the budget less the weights, preempting a sequence before going over."""
        from forge.batching.cost import CostModel
        from forge.runtime.cost.models import causal_lm_cost_model

        forward = causal_lm_cost_model(self)
        self.kv_model = CostModel(
            weight_bytes=forward.weight_bytes,
            bytes_per_token=forward.kv_bytes_per_token,
            bytes_per_score=0.0,
            kv_bytes_per_token=0.0,
            margin=forward.margin,
        )
        return self.kv_model

    def finished(self, text: str, label: Any) -> dict[str, Any]:
        """The function's own result fields of a row whose generation ended, from its generated `text`
        and its prompt's `label` (say, whether the answer matches): {field: value}, every call the same
        fields, each declared in `fields`. The base adds none."""
        return {}

    # -- running --------------------------------------------------------------------------
    def open_worker(self, device, cache_tokens: int):
        from forge.runtime.decoder.worker import open_generate_worker

        return open_generate_worker(self, device, cache_tokens)

    def open_sink(self, store):
        from forge.runtime.decoder.worker import GenerateSink

        return GenerateSink(super().open_sink(store))
