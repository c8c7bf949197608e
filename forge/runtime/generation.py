"""Generation for a batch of prompts: transformers' continuous batching, under a tokens-per-step budget.

Model: a Forge batch is a set of prompts that one worker runs to completion. They go to
transformers' continuous-batching engine (`ContinuousBatchingManager`: a paged KV cache whose
pages are shared between prompts with a common prefix, and a scheduler that fills each step
with chunks of new prompts plus one token per running sequence, at most `tokens_per_step`
tokens; when its pages run out it offloads or re-queues a sequence instead of failing). Greedy
decoding there equals one-prompt-at-a-time `generate` token for token (tests/test_generate.py).

Around it, Forge adds what a batch job needs: per-row ``max_new_tokens`` and stop strings (the
text is cut before the first stop string; the tokens keep the one that completed it, as
`generate`'s stop strings do), a finish reason, the step sizes the engine actually ran (a
histogram: the ledger checks no step went over the budget), and the activations of the generated
tokens, from Forge's own exact forward pass over each final sequence (`CausalLMRunner`, rows of
whole sequences: they equal a plain forward over it).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

PAGE_TOKENS = 32  # KV page size: prompts share whole pages of a common prefix
RESULT_WAIT_S = 1.0  # how long one wait for the engine's next result lasts


@dataclass(frozen=True)
class RowLimits:
    """`ItemMeta.data` of a generate item: its own limits."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Generated:
    """One prompt's outcome."""

    ids: list[int]
    text: str
    finish_reason: str  # length | stop | eos


@dataclass
class StepLog:
    """What the engine's scheduler ran, step by step, while a batch was generating (one per process)."""

    steps: list[int] = field(default_factory=list)  # query tokens of each step
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: bool = False


STEPS = StepLog()
_wrapped = False


class _YoungCollections:
    """Stands in for `gc` in transformers' continuous-batching module, whose manager runs two full
    collections each time it stops, once per Forge batch: ~0.25 s each in a process holding a few
    hundred thousand objects (a test run, a driver with its input), more than a small batch's whole
    generation. The engine's cache and tensors hold no reference cycles: reference counting frees
    them when the manager goes (tests/test_generate.py); only the young generation is collected here."""

    @staticmethod
    def collect(generation: int = 2) -> int:
        import gc

        return gc.collect(0)


def record_steps() -> None:
    """Wrap the engine's schedulers once so that each step's query tokens are logged while `STEPS.active`
    (and let its manager stop without full collections: `_YoungCollections`)."""
    global _wrapped
    if _wrapped:
        return
    from transformers.generation.continuous_batching import continuous_api, scheduler

    continuous_api.gc = _YoungCollections  # type: ignore[assignment]

    for cls in set(scheduler.SCHEDULER_MAPPING.values()):
        original = cls.schedule_batch

        def schedule_batch(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            if STEPS.active and out[0]:
                with STEPS.lock:
                    STEPS.steps.append(int(out[2]))
            return out

        cls.schedule_batch = schedule_batch  # type: ignore[method-assign]
    _wrapped = True


def cut_at_stop(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[list[int], str, bool]:
    """(the ids up to the token that completes the first stop string, the text before it, whether one
    was found); without one, all of them and their text."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return ids, text, False
    at, s = min(hits)
    end = at + len(s)
    for k in range(1, len(ids) + 1):  # the first prefix of the ids whose text holds the stop string whole
        if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= end:
            return ids[:k], text[:at], True
    return ids, text[:at], True


class Engine:
    """A loaded causal LM generating batches of prompts with continuous batching."""

    def __init__(self, model: Any, tokenizer: Any, tokens_per_step: int, eos: bool = True, pad_token_id: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.tokens_per_step = int(tokens_per_step)
        ids = model.generation_config.eos_token_id if eos else None
        self.eos = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        self.pad_token_id = pad_token_id
        record_steps()

    def generate(self, prompts: list[list[int]], limits: list[RowLimits]) -> tuple[list[Generated], list[int]]:
        """Each prompt's generation, in order, and the query tokens of every engine step."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        longest = max(m.max_new_tokens for m in limits)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=longest,
            eos_token_id=sorted(self.eos) or None,
            pad_token_id=self.pad_token_id,
        )
        need = sum(-(-(len(p) + m.max_new_tokens) // PAGE_TOKENS) for p, m in zip(prompts, limits))
        engine = ContinuousBatchingConfig(
            page_size=PAGE_TOKENS,
            num_blocks=need + 1,  # every sequence's pages at their longest: no sequence waits for room
            max_batch_tokens=self.tokens_per_step,
            use_cuda_graph=False,
            auto_switch_to_flash=False,  # the attention the model was checked with
        )
        with STEPS.lock:
            STEPS.steps, STEPS.active = [], True
        try:
            outputs = self._run(prompts, limits, config, engine)
        finally:
            with STEPS.lock:
                steps, STEPS.active = STEPS.steps, False
        return [self._finish(outputs[str(k)], m) for k, m in enumerate(limits)], steps

    def _run(self, prompts, limits, config, engine) -> dict[str, Any]:
        results: dict[str, Any] = {}
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=engine, block=True, timeout=30, warmup=False
        ) as manager:
            for k, (p, m) in enumerate(zip(prompts, limits)):
                manager.add_request(list(p), request_id=str(k), max_new_tokens=m.max_new_tokens)
            while len(results) < len(prompts):
                out = manager.get_result(timeout=RESULT_WAIT_S)
                if out is not None and out.is_finished():
                    if out.error is not None:
                        raise RuntimeError(f"generation failed: {out.error}")
                    results[out.request_id] = out
                elif out is None and not manager.is_running():
                    raise RuntimeError("the continuous-batching engine stopped before every prompt finished")
        return results

    def _finish(self, out: Any, limits: RowLimits) -> Generated:
        ids = [int(t) for t in out.generated_tokens][: limits.max_new_tokens]
        ids, text, stopped = cut_at_stop(self.tokenizer, ids, limits.stop)
        if stopped:
            return Generated(ids, text, "stop")
        if ids and ids[-1] in self.eos:
            return Generated(ids, text, "eos")
        return Generated(ids, text, "length")


def step_histogram(steps: list[int], budget: int) -> dict[str, int]:
    """Steps by their query tokens, in power-of-two bins up to the budget ("<=B": steps of at most B tokens)."""
    bins: Counter[str] = Counter()
    edges = [1 << k for k in range(max(1, int(budget).bit_length()) + 1)]
    for n in steps:
        bins[f"<={next((e for e in edges if n <= e), n)}"] += 1
    return dict(sorted(bins.items(), key=lambda kv: int(kv[0][2:])))


def final_states(runner: Any, items: list[Any], generated: list[list[int]], from_prompt: bool) -> list[dict]:
    """Per item, {layer or point: [tokens, ...]}: the states of its generated tokens (and its prompt's
    own tokens before them, `from_prompt`) from a plain forward over the final sequence."""
    from forge.vocab.geometry import Batch, Item

    seqs = [
        Item(it.id, len(it.tokens) + len(g), None, 0, [*it.tokens, *g], None, it.index)
        for it, g in zip(items, generated)
    ]
    out: list[dict] = []
    width = max(s.num_tokens for s in seqs)
    states = runner.forward_tokens(Batch([[s] for s in seqs], width))
    for k, it in enumerate(items):
        first = it.prefix_len if from_prompt else len(it.tokens)
        row, start, n = int(states.item_row[k]), int(states.starts[k]), int(states.lens[k])
        picked = {}
        for layer, i in zip(runner.layers, runner._layer_idx):
            picked[f"layer_{layer}"] = states.hidden[i][row, start + first : start + n]
        for name, value in states.captured.items():
            picked[name] = value[row, start + first : start + n].flatten(1)
        out.append(picked)
    return out
