"""The generate function's worker and sink: a batch of prompts through the engine, its figures into the report.

`GenerateWorker.run(batch)` generates every item of the batch (`forge.runtime.decode.Decoder`)
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

from forge.runtime.decode import Decoder, Sequence
from forge.runtime.generation import RowLimits, final_states, finish, step_histogram
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

    def run(self, batch) -> GenerationColumns:
        items = batch.items
        seqs = []
        limits = [it.meta.data if isinstance(it.meta.data, RowLimits) else RowLimits(1) for it in items]
        for k, (it, lim) in enumerate(zip(items, limits)):
            sampling = self.decoder.sampling
            rng = None if sampling is None else sampling.stream(str(it.id))
            seqs.append(Sequence(k, list(it.tokens), it.prefix_len, lim.max_new_tokens, lim.stop, rng))
        t0 = time.perf_counter()
        run = self.decoder.generate(seqs)
        seconds = time.perf_counter() - t0
        eos = self.decoder.eos
        done = [finish(self.decoder.tokenizer, s.out, lim, eos) for s, lim in zip(seqs, limits)]
        columns: dict[str, Any] = {
            "generated_ids": [np.asarray(g.ids, np.int32) for g in done],
            "text": [g.text for g in done],
            "finish_reason": [g.finish_reason for g in done],
            "num_prompt_tokens": np.asarray([len(it.tokens) for it in items], np.int32),
            "num_generated_tokens": np.asarray([len(g.ids) for g in done], np.int32),
        }
        if self.runner is not None:
            import torch

            with torch.inference_mode():
                states = final_states(self.runner, items, [g.ids for g in done], self.from_prompt, self.budget)
            for name in states[0] if states else ():
                columns[name] = [s[name].float().cpu().numpy() for s in states]
        prompt = sum(len(it.tokens) for it in items)
        generated = sum(len(g.ids) for g in done)
        figures = GenerationFigures(
            prompt, generated, run.steps, run.decode_tokens, seconds, self.budget, run.prefix_hits,
            run.preempted, run.recomputed_tokens, run.kv_peak_bytes, self.decoder.kv_bytes, run.prefill_pads,
            run.prefix_stored_tokens,
        )  # fmt: skip
        # the ledger's prefix tokens of a split batch: what the decoder actually prefilled of them
        own = sum(len(it.tokens) - it.prefix_len for it in items)
        prefixes = sum(it.prefix_len for it in items)
        computed = min(prefixes, max(0, figures.prefill_computed - own))
        if batch.split_prefix:
            return GenerationColumns(columns, computed, False, None, figures)
        hit = min(prefixes - computed, figures.prefix_stored_tokens)  # the rest: computed once for several
        return GenerationColumns(columns, 0, False, (hit, prefixes - computed - hit), figures)

    def close(self) -> None:
        self.decoder = None  # type: ignore[assignment]
        self.runner = None
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


class GenerateSink:
    """The generic sink, plus the engine's figures added up for the report."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.prompt = self.generated = self.seconds_total = 0
        self.prefill = self.prefill_pads = 0
        self.steps: list[int] = []
        self.budget = 0
        self.prefix_hits = self.preempted = self.recomputed = self.kv_peak_bytes = 0
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
            "kv_budget_bytes": self.kv_budget,  # batching=memory: the device's budget less weights and a step
            "steps": len(self.steps),
            "largest_step_tokens": max(self.steps, default=0),
            "tokens_per_step_budget": self.budget,
            "steps_by_tokens": step_histogram(self.steps, self.budget or 1),
            "output_tokens_per_s": round(self.generated / self.seconds_total, 1) if self.seconds_total else None,
            "ms_per_output_token": round(1000 * self.seconds_total / self.generated, 3) if self.generated else None,
        }
        return out
