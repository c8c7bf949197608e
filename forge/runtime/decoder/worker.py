"""The generate function's worker and sink: a batch of prompts through the engine, its figures into the report.

`GenerateWorker.run(batch)` generates every item of the batch (`forge.runtime.decoder.engine.Decoder`)
and returns `GenerationColumns`: the result fields, one row per item, plus what the engine did
(`GenerationFigures`). `GenerateSink` commits the rows through the generic sink and adds the
figures up for the report (``outputs.generation``): prompt, prefill and generated tokens, the
steps by their size (none over the budget), time per output token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge.runtime.decoder.engine import Decoder, Sequence
from forge.runtime.decoder.finish import RowLimits, final_states, finish, step_histogram
from forge.vocab.records import ResultColumns


@dataclass
class GenerationFigures:
    """What the engine did for one batch."""

    prompt_tokens: int  # the items' prompt tokens (prefix included)
    generated_tokens: int
    steps: list[int]  # query tokens of each engine step
    decode_tokens: int  # tokens of decode steps: one per running sequence and step
    seconds: float  # generating (not the states' forward pass)
    budget: int  # the step budget it ran under (tokens)
    prefix_hits: int = 0  # prompt blocks whose shared prefix's KV the worker had stored
    preempted: int = 0  # sequences whose slots were freed for the KV budget, their tokens recomputed later
    recomputed_tokens: int = 0  # the tokens those sequences had generated, prefilled again
    kv_peak_bytes: int = 0  # the most the decoder's keys and values held at once (accounted)
    kv_budget_bytes: int | None = None  # what they may hold (batching=memory); None: no limit
    prefill_pads: int = 0  # pad slots prompt blocks ran through the model (masked work, not tokens)
    prefix_stored_tokens: int = 0  # prefix tokens of items whose prefix the worker had stored before the batch
    kv_held_peak_bytes: int = 0  # the most its sequences' and prefixes' tokens needed at once

    @property
    def prefill_computed(self) -> int:
        """Prompt tokens the decoder ran: fewer where a shared prefix's KV was reused."""
        return sum(self.steps) - self.decode_tokens


@dataclass
class GenerationColumns(ResultColumns):
    figures: GenerationFigures | None = None


@dataclass
class GenerateWorker:
    decoder: Decoder
    runner: Any  # a CausalLMRunner for the generated tokens' states (None: none asked)
    from_prompt: bool  # states of the prompt's own tokens too
    budget: int  # tokens per engine step
    on_close: Any = None  # what closing releases beside the model (a device group's offload folder)
    part_rows: int = 0  # with `emit`, finished rows are handed on in parts of at least this many (0: whole)
    # the function's own fields of a finished row, from its text and label (`GenerativeFunction.finished`)
    finished: Any = None
    sources: Any = None  # row-dependent interventions' patch sources' activations (a SourceValues), or None
    streams = True  # `run(batch, emit)` hands finished rows on while the rest decode (forge.executors.worker)

    def run(self, batch, emit: Any = None) -> GenerationColumns:
        """Generate every item of the batch. `emit(positions, output)`: where parts of at least
        `part_rows` finished items go while others still decode (so a kill keeps them: the loop
        commits them at once); the returned output is then for the items not emitted."""
        items = batch.items
        seqs = []
        limits = [row_limits(it) for it in items]
        for k, (it, lim) in enumerate(zip(items, limits)):
            sampling = self.decoder.sampling
            rng = None if sampling is None else sampling.stream(str(it.id))
            seq = Sequence(k, list(it.tokens), it.prefix_len, lim.max_new_tokens, lim.stop, rng)
            seq.prefix_tag = self.prefix_tag(it)
            seqs.append(seq)
        table = self._table(items)
        prefixes = PrefixShares(items, self.decoder, self.prefix_tag)
        ready: list[int] = []  # finished, not emitted yet
        given: list[int] = []
        sent = [0, 0, 0]  # what the emitted parts carried: prefix tokens hit and shared, generated tokens

        def finished(ended: list[Sequence]) -> None:
            ready.extend(seq.index for seq in ended)
            if emit is not None and self.part_rows and len(ready) >= self.part_rows:
                if len(given) + len(ready) < len(items):  # the batch's own outcome keeps at least one
                    ready.sort()  # a part's output is in its batch's order (`Batch.select`)
                    columns = self._columns([items[k] for k in ready], [seqs[k] for k in ready], limits, ready)
                    hit, shared, runs = prefixes.of(ready)
                    sent[0], sent[1] = sent[0] + hit, sent[1] + shared
                    sent[2] += int(columns["num_generated_tokens"].sum())
                    engine = None if batch.split_prefix else (hit, shared, runs)
                    emit(list(ready), GenerationColumns(columns, 0, False, engine))
                    given.extend(ready)
                    ready.clear()

        t0 = time.perf_counter()
        run = self.decoder.generate(seqs, finished, table)
        seconds = time.perf_counter() - t0
        rest = [k for k in range(len(items)) if k not in set(given)]
        columns = self._columns([items[k] for k in rest], [seqs[k] for k in rest], limits, rest)
        prompt = sum(len(it.tokens) for it in items)
        generated = sent[2] + int(columns["num_generated_tokens"].sum())
        figures = GenerationFigures(
            prompt, generated, run.steps, run.decode_tokens, seconds, self.budget, run.prefix_hits,
            run.preempted, run.recomputed_tokens, run.kv_peak_bytes, self.decoder.kv_bytes, run.prefill_pads,
            run.prefix_stored_tokens, run.kv_held_peak_bytes,
        )  # fmt: skip
        # the ledger's prefix tokens of a split batch: what the decoder actually prefilled of them
        own = sum(len(it.tokens) - it.prefix_len for it in items)
        total = sum(it.prefix_len for it in items)
        left = sum(items[k].prefix_len for k in rest)  # the prefix tokens of the items returned here
        computed = min(total, max(0, figures.prefill_computed - own))
        if batch.split_prefix:
            return GenerationColumns(columns, min(left, computed), False, None, figures, steps=run.steps)
        hit = min(total - computed, figures.prefix_stored_tokens)  # the rest: computed once for several
        shared = total - computed - hit - sent[1]
        hit = min(left, max(0, hit - sent[0]))
        shared = min(left - hit, max(0, shared))
        runs = prefixes.of(rest)[2]
        return GenerationColumns(columns, 0, False, (hit, shared, runs), figures, steps=run.steps)

    def prefix_tag(self, item: Any) -> Any:
        """What besides its tokens decides an item's prefix KV (`Sequence.prefix_tag`): with row-dependent
        interventions, its prefix key, which carries what its own parameters change in its prefix."""
        return item.prefix_key if self.row_steered else None

    @property
    def row_steered(self) -> bool:
        """Some intervention's values are each row's own (else every row is steered alike, or not at all)."""
        hooks = self.decoder.hooks
        return hooks is not None and hooks.row_dependent

    def _table(self, items: list) -> Any:
        """The batch's per-item intervention parameters (None: every row is steered alike)."""
        if not self.row_steered:
            return None
        import torch

        from forge.runtime.hooks.row_tables import RowTables
        from forge.runtime.model.hf_compat import input_device

        with torch.inference_mode():
            sources = {} if self.sources is None else self.sources.of(items, input_device(self.decoder.model))
        return RowTables(items, self.decoder.hooks.interventions, sources)

    def _columns(self, items: list, seqs: list[Sequence], limits: list[RowLimits], at: list[int]) -> dict[str, Any]:
        """The result fields of these items (their sequences ended)."""
        eos = self.decoder.eos
        done = [finish(self.decoder.tokenizer, s.out, limits[k], eos) for s, k in zip(seqs, at)]
        columns: dict[str, Any] = {
            "generated_ids": [np.asarray(g.ids, np.int32) for g in done],
            "text": [g.text for g in done],
            "finish_reason": [g.finish_reason for g in done],
            "num_prompt_tokens": np.asarray([len(it.tokens) for it in items], np.int32),
            "num_generated_tokens": np.asarray([len(g.ids) for g in done], np.int32),
        }
        if self.runner is not None and items:
            import torch

            with torch.inference_mode():
                states = final_states(self.runner, items, [g.ids for g in done], self.from_prompt, self.budget)
            for name in states[0] if states else ():
                columns[name] = [s[name].float().cpu().numpy() for s in states]
        if self.finished is not None and items:  # the function's own fields, as a reduce's are collected
            from forge.runtime.forward.views import collect

            own = [self.finished(g.text, getattr(it.meta, "label", None)) for g, it in zip(done, items)]
            columns.update(collect(own, list(own[0])))
        return columns

    def close(self) -> None:
        self.decoder = None  # type: ignore[assignment]
        self.runner = None
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


def row_limits(item: Any) -> RowLimits:
    """An item's own limits (`Generate.prompts` gives every item them); an item without: an error."""
    limits = getattr(getattr(item, "meta", None), "data", None)
    if not isinstance(limits, RowLimits):
        raise ValueError(f"generate: item {item.id!r} carries no RowLimits (max_new_tokens): made outside Generate?")
    return limits


def open_generate_worker(fn: Any, device: Any, cache_tokens: int) -> GenerateWorker:
    """A generative function's worker on `device` (`forge.api.GenerativeFunction.open_worker`): its
    model loaded (a device group: onto its members by the plan's map), the decoder under the step
    budget and the KV budget (batching=memory), its stored prefixes bounded by `cache_tokens` (the
    run's batching.cache_tokens; 0, a mode without a prefix cache: PREFIX_TOKENS), steered by
    the function's interventions, and a forward runner for the generated tokens' states when it asks
    for them."""
    from transformers import AutoModelForCausalLM

    from forge.runtime.decoder.prefill import PREFIX_TOKENS
    from forge.runtime.decoder.sampling import Sampling
    from forge.runtime.placement.dispatch import dispatch_for

    dispatch = dispatch_for(fn, device)
    loader, attn = AutoModelForCausalLM, fn.caps.attn
    model = dispatch.load(fn.hf, loader, attn) if dispatch else fn.hf.load(loader, device.torch_device, attn)
    ids = model.generation_config.eos_token_id if fn.eos else None
    eos = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    budget = device.steps().tokens  # the step budget (forge.vocab.geometry.StepBudget, from batch_device)
    kv_bytes = None  # batching=memory: the device's budget less the weights and a step's activations
    if fn.kv_model is not None and device.memory_bytes:
        kv_bytes = max(0, device.memory_bytes - fn.kv_model.weight_bytes)
    steer = sources = None
    if fn.interventions:  # the prompt's, the prefix's and each generated token's forward pass, by span
        from forge.runtime.hooks.points import HookSet
        from forge.runtime.hooks.row_tables import SourceValues
        from forge.runtime.model.hf_compat import base_decoder, num_layers

        base, depth = base_decoder(model), num_layers(fn.config)
        hooks = HookSet(model, base, depth, [], list(fn.interventions.items))
        steer = (hooks, fn.interventions.key)
        if hooks.patch_points:  # each source row's activations, its prompt alone through the plain model
            sources = SourceValues(model, base, depth, hooks.patch_points)
    decoder = Decoder(
        model, fn.tokenizer, budget, eos, fn.hf.pad_token_id, Sampling(*fn.sampling),
        prefix_tokens=cache_tokens or PREFIX_TOKENS, kv_bytes=kv_bytes, max_running=fn.max_running,
        steer=steer,
    )  # fmt: skip
    runner = None
    if fn.states:
        from forge.runtime.forward.causal_lm import CausalLMRunner

        layers, captures = list(fn.forward.layers), list(fn.forward.capture)
        runner = CausalLMRunner(model, layers=layers, pad_token_id=fn.hf.pad_token_id, caps=fn.caps,
                                allow_no_layers=True, captures=captures)  # fmt: skip
    close = dispatch.close if dispatch else None
    return GenerateWorker(
        decoder, runner, fn.states_of_prompt, budget, close, int(fn.cfg.shard_size), fn.finished, sources
    )  # fmt: skip


class PrefixShares:
    """How a batch's items had their shared prefix, for the ledger of the parts it is emitted in:
    held by the worker before the batch (hit), or computed in it, the first item of a prefix paying
    for it and the others sharing it."""

    def __init__(self, items: list, decoder: Decoder, tag: Any):
        self.items, self.decoder = items, decoder
        self.tag = tag  # an item's Sequence.prefix_tag (GenerateWorker.prefix_tag)
        self.stored = set(decoder.prefixes.keys())
        self.paid: set = set()

    def of(self, positions: list[int]) -> tuple[int, int, int]:
        """(hit, shared) prefix tokens of these items, each item counted once, in the order given, and
        the prefixes computed for them (each item that paid for its prefix)."""
        hit = shared = runs = 0
        for k in positions:
            item = self.items[k]
            key = self.decoder.prefix_key(item.tokens, item.prefix_len, self.tag(item))
            if not key[1]:
                continue
            if key in self.stored:
                hit += item.prefix_len
            elif key in self.paid:
                shared += item.prefix_len
            else:
                self.paid.add(key)
                runs += 1
        return hit, shared, runs


class GenerateSink:
    """The generic sink, plus the engine's figures added up for the report."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.prompt = self.generated = self.seconds_total = 0
        self.prefill = self.prefill_pads = 0
        self.steps: list[int] = []
        self.budget = 0
        self.prefix_hits = self.preempted = self.recomputed = self.kv_peak_bytes = self.kv_held = 0
        self.kv_budget: int | None = None

    def write(self, batch, output, keep) -> None:
        self.inner.write(batch, output, keep)
        f = getattr(output, "figures", None)
        if f is not None:
            self.prompt += f.prompt_tokens
            self.generated += f.generated_tokens
            self.prefill += f.prefill_computed
            self.prefill_pads += f.prefill_pads
            self.steps += f.steps
            self.seconds_total += f.seconds
            self.budget = max(self.budget, f.budget)
            self.prefix_hits += f.prefix_hits
            self.preempted += f.preempted
            self.recomputed += f.recomputed_tokens
            self.kv_peak_bytes = max(self.kv_peak_bytes, f.kv_peak_bytes)
            self.kv_held = max(self.kv_held, f.kv_held_peak_bytes)
            if f.kv_budget_bytes is not None:
                self.kv_budget = min(self.kv_budget or f.kv_budget_bytes, f.kv_budget_bytes)

    def full(self) -> bool:
        return self.inner.full()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> dict[str, Any]:
        out = dict(self.inner.close())
        out["generation"] = {
            "prompt_tokens": self.prompt,
            "prefill_tokens_computed": self.prefill,
            "prefill_tokens_shared": self.prompt - self.prefill,  # negative: recomputed after preemption
            "prefill_pad_slots": self.prefill_pads,  # masked pads prompt blocks ran through the model
            "prefix_cache_hits": self.prefix_hits,
            "generated_tokens": self.generated,
            "preempted": self.preempted,  # sequences put back for the KV budget, then recomputed
            "recomputed_tokens": self.recomputed,  # the tokens they had generated, prefilled again
            "kv_peak_bytes": self.kv_peak_bytes,
            "kv_held_peak_bytes": self.kv_held,  # what the sequences' and prefixes' tokens needed at most (rows layout)
            "kv_budget_bytes": self.kv_budget,  # batching=memory: the device's budget less weights and a step
            "steps": len(self.steps),
            "largest_step_tokens": max(self.steps, default=0),
            "tokens_per_step_budget": self.budget,
            "steps_by_tokens": step_histogram(self.steps, self.budget or 1),
            "output_tokens_per_s": round(self.generated / self.seconds_total, 1) if self.seconds_total else None,
            "ms_per_output_token": round(1000 * self.seconds_total / self.generated, 3) if self.generated else None,
        }
        return out
