"""score: log-likelihoods of continuations under a shared context, as lm-evaluation-harness
defines them, and multiple-choice accuracy. Written on `forge.api`.

Rows: ``{context, continuation, id?}`` (one item) or ``{context, choices, gold?, id?}`` (one item per
choice, continuation ``target_delimiter + choice``). Tokens follow lm-eval's ``_encode_pair``: the
context's trailing whitespace moves to the continuation; ``cont = enc(context + continuation)[len(ctx):]``
with ``ctx = enc(context)`` (the tokenizer's BOS first unless ``add_special_tokens=false``; an empty
context is the BOS). The model reads ``ctx + cont[:-1]``, cut from the left to ``max_length``. The
prefix (shared by a question's choices) is the context minus its last token; the item's own tokens,
that token and ``cont[:-1]``, predict ``cont`` (every item needs a token of its own).
Output: ``scores/`` Parquet rows (`load_scores`); acc and acc_norm per question in ``questions.parquet``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge import api
from forge.api import CausalLMFunction, Column, Field, Forward, ItemView, ModelFunctionConfig, Prompt, Row, Tokens

_Encoder = api.PairEncoder  # lm-eval's (context, continuation) encoding

QUESTIONS = "questions.parquet"
DEFAULT_MAX_LENGTH = 2048  # lm-eval's when the model's config names no maximum


@dataclass
class ScoreConfig(ModelFunctionConfig):
    """The root keys score reads, checked at the edge."""

    target_delimiter: str = " "  # multiple choice: each continuation is target_delimiter + choice (lm-eval's default)
    # start every context with what the tokenizer adds (BOS for Llama; nothing for GPT-2)
    add_special_tokens: bool = True
    # tokens the model reads, cut from the left of the context; null: the model's maximum
    max_length: int | None = api.positive(None)


@dataclass(slots=True)
class Choice:
    """What an item carries to its result row (`Prompt.data`)."""

    question: str  # the row's id (a multiple-choice question, or the plain row itself)
    choice: int  # index among the question's choices; -1 for a plain row
    num_choices: int  # choices of the question; 1 for a plain row
    gold: int  # the correct choice; -1 when the row names none
    num_bytes: int  # UTF-8 bytes acc_norm divides by: the choice (no delimiter), or the continuation
    truncated: int = 0  # context tokens cut from the left to fit max_length
    ids: tuple | None = None  # (context ids, continuation ids) a row gave as tokens (lm-eval's rolling windows)


class Score(CausalLMFunction):
    name = "score"
    config_schema = ScoreConfig
    forward = Forward(targets=True)
    columns = {
        "context": api.MayBeEmpty(required=True),
        "continuation": Column(),
        "id": Column(kinds=("string", "integer")),
    }
    folder = "scores"
    fields = (
        Field("question", "string"),
        Field("choice", "int32"),
        Field("num_choices", "int32"),
        Field("gold", "int32"),
        Field("loglik", "float64"),
        Field("num_tokens", "int32"),
        Field("greedy", "bool"),
        Field("num_bytes", "int32"),
        Field("truncated", "int32"),
    )

    def __init__(self, config: ScoreConfig):
        super().__init__(config)
        self.target_delimiter, self.add_special_tokens = str(config.target_delimiter), bool(config.add_special_tokens)
        self.max_length = int(config.max_length) if config.max_length else self._model_max_length()
        self._encoder: api.PairEncoder | None = None
        self._truncated = 0

    def _model_max_length(self) -> int:
        """lm-eval's rule: the config's maximum positions, else the tokenizer's, else 2048."""
        from forge.api import text_config

        values = [
            getattr(text_config(self.config), k, None) for k in ("n_positions", "max_position_embeddings", "n_ctx")
        ]
        values.append(getattr(self.tokenizer, "model_max_length", None))
        return next((v for v in values if isinstance(v, int) and 0 < v < 1 << 30), DEFAULT_MAX_LENGTH)

    def options(self) -> dict[str, Any]:
        return {
            "token_rule": _Encoder.RULE,
            "target_delimiter": self.target_delimiter,
            "add_special_tokens": self.add_special_tokens,
            "max_length": self.max_length,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_encoder": None}

    def expected_items(self) -> int | None:
        return None  # multiple-choice rows expand to several items: unknown until read

    def warnings(self) -> list[str]:
        out = super().warnings()
        if self._encoder is not None and self._encoder.dropped_eos:
            out.append("the tokenizer appends EOS to every text: score drops it (between context and continuation)")
        if self._truncated:
            out.append(
                f"{self._truncated} item(s) read more than max_length={self.max_length} tokens: their "
                "contexts were cut from the left (column 'truncated' counts the tokens)"
            )
        return out

    # -- rows -> items ------------------------------------------------------------------
    def prompts(self, row: Row) -> list[Prompt] | str:
        context, continuation, choices = row.data["context"], row.data.get("continuation"), row.data.get("choices")
        if "continuation_ids" in row.data:  # a window of token ids, as lm-eval's loglikelihood_rolling makes them
            ids = (list(row.data.get("context_ids") or ()), list(row.data["continuation_ids"]))
            return [Prompt(str(context) or " ", "", data=Choice(row.id, -1, 1, -1, 0, ids=ids))]
        if (continuation is None) == (choices is None):
            what = "has both 'continuation' and 'choices'" if choices is not None else "has no 'continuation'"
            return f"{what}; give a string 'continuation', or a list 'choices' with 'gold'"
        if continuation is not None:
            if not continuation:
                return f"has an empty 'continuation' ({api.short_id(continuation)}); it needs at least one character"
            return [Prompt(continuation, context, data=Choice(row.id, -1, 1, -1, len(continuation.encode())))]
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            return f"'choices' must be a non-empty list of non-empty strings, got {api.short_id(choices)}"
        gold = row.data.get("gold")
        if gold is not None and (isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices)):
            return f"'gold' is {api.short_id(gold)}, not a choice index 0..{len(choices) - 1}; fix it or leave it out"
        gold = -1 if gold is None else gold
        return [
            Prompt(
                self.target_delimiter + c,
                context,
                suffix=str(k),
                data=Choice(row.id, k, len(choices), gold, len(c.encode())),
            )
            for k, c in enumerate(choices)
        ]

    def tokenize(self, prompts: list[Prompt]) -> list[Tokens | str]:
        if self._encoder is None:
            self._encoder = _Encoder(self.tokenizer, self.add_special_tokens)
        pairs = iter(self._encoder.pairs([(p.prefix, p.text) for p in prompts if p.data.ids is None]))
        return [self._tokens(p, *(p.data.ids if p.data.ids is not None else next(pairs))) for p in prompts]

    def _tokens(self, p: Prompt, ctx: list[int], cont: list[int]) -> Tokens | str:
        if not cont:
            return f"continuation {p.text!r} has no tokens of its own after the context"
        if len(cont) > self.max_length:
            return (
                f"continuation {p.text[:30]!r}... has {len(cont)} tokens, more than max_length={self.max_length}; "
                "shorten it or raise max_length"
            )
        run = (ctx + cont[:-1])[max(0, len(ctx) + len(cont) - 1 - self.max_length) :]  # what the model reads
        p.data.truncated = len(ctx) + len(cont) - 1 - len(run)
        self._truncated += p.data.truncated > 0
        at = len(run) - len(cont)  # the prefix: the context minus its last token, whose state predicts cont[0]
        key = hashlib.sha1(np.asarray(run[:at], np.int64).tobytes()).hexdigest()[:16] if at else None
        return Tokens(run[:at], run[at:], key, tuple(cont), target_start=at)

    # -- results ------------------------------------------------------------------------
    def reduce(self, view: ItemView) -> dict[str, Any]:
        c: Choice = view.data
        return {
            "question": c.question,
            "choice": c.choice,
            "num_choices": c.num_choices,
            "gold": c.gold,
            "loglik": view.logprobs.double().sum(),
            "num_tokens": view.targets.numel(),
            "greedy": view.greedy.all(),
            "num_bytes": c.num_bytes,
            "truncated": c.truncated,
        }

    def open_sink(self, store):
        return _QuestionSink(super().open_sink(store), store)


class _QuestionSink:
    """The generic sink, plus acc and acc_norm per question over every committed row at close."""

    def __init__(self, sink, store):
        self.sink, self.store, self.full, self.write, self.flush = sink, store, sink.full, sink.write, sink.flush

    def close(self) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        out, questions = self.sink.close(), question_table(load_scores(self.store.url()))
        if questions.num_rows:
            buffer = pa.BufferOutputStream()
            pq.write_table(questions, buffer)
            self.store.write_file(QUESTIONS, buffer.getvalue().to_pybytes())  # replaced whole (a path or a URL)
            out["questions"] = self.store.url(QUESTIONS)
        return {**out, "accuracy": accuracy(questions)}


def load_scores(run_dir):
    """Every committed score row of a run (pyarrow Table, input order; gold -1: none)."""
    return api.load_results(run_dir, "scores").table()


def question_table(scores):
    """Per multiple-choice question with a gold index and every choice scored: pred (argmax of
    loglik), pred_norm (argmax of loglik / num_bytes), acc, acc_norm (ties: the first choice, as lm-eval)."""
    import pyarrow as pa

    found: dict[str, tuple[int, int, dict[int, tuple[float, int]]]] = {}
    for q, c, k, g, ll, nb in zip(
        *(scores.column(n).to_pylist() for n in ("question", "choice", "num_choices", "gold", "loglik", "num_bytes"))
    ):
        if c >= 0 and g is not None and g >= 0:
            found.setdefault(q, (k, g, {}))[2][c] = (ll, max(nb, 1))
    done = [(q, k, g, [got[c] for c in range(k)]) for q, (k, g, got) in found.items() if len(got) == k]  # all scored
    pred = [int(np.argmax([ll for ll, _ in ch])) for *_, ch in done]
    norm = [int(np.argmax([ll / nb for ll, nb in ch])) for *_, ch in done]
    gold = [g for _, _, g, _ in done]
    columns = {
        "question": [d[0] for d in done],
        "num_choices": [d[1] for d in done],
        "gold": gold,
        "pred": pred,
        "pred_norm": norm,
        "acc": [float(p == g) for p, g in zip(pred, gold)],
        "acc_norm": [float(p == g) for p, g in zip(norm, gold)],
    }
    kinds = {"question": pa.string(), "acc": pa.float64(), "acc_norm": pa.float64()}
    return pa.table(columns, schema=pa.schema([(name, kinds.get(name, pa.int32())) for name in columns]))


def accuracy(questions) -> dict[str, Any]:
    """Mean acc and acc_norm over the questions (None without any)."""
    if not (n := questions.num_rows):
        return {"questions": 0, "acc": None, "acc_norm": None}
    acc, norm = (np.asarray(questions.column(c).to_pylist()) for c in ("acc", "acc_norm"))
    return {"questions": n, "acc": round(float(acc.mean()), 6), "acc_norm": round(float(norm.mean()), 6)}


def accuracy_line(acc: dict[str, Any]) -> str:  # `accuracy` in forge run's summary (forge.cli.summary)
    return f"acc {acc['acc']:.4f}  acc_norm {acc['acc_norm']:.4f}  ({acc['questions']:,} questions)"


def load_questions(run_dir):
    """acc and acc_norm per multiple-choice question of a run (pyarrow Table), from its scores."""
    return question_table(load_scores(run_dir))
