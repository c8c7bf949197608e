"""score: log-likelihoods of continuations under a shared context, as lm-evaluation-harness
defines them, and multiple-choice accuracy.

Rows (JSONL or Parquet):
* ``{"context": str, "continuation": str, "id"?}``: one item;
* ``{"context": str, "choices": [str, ...], "gold"?: int, "id"?}``: one item per choice, whose
  continuation is ``target_delimiter + choice`` (lm-eval's multiple_choice request).

Tokenization follows lm-eval's ``_encode_pair``: the context's trailing whitespace moves to the
start of the continuation; ``whole = enc(context + continuation)``, ``ctx = enc(context)``, and the
continuation's tokens are ``whole[len(ctx):]``. ``enc`` adds what the tokenizer adds at the start
(a BOS for Llama-style tokenizers, nothing for GPT-2) unless ``add_special_tokens=false``; a
trailing EOS a tokenizer appends is never kept. An empty context is the tokenizer's BOS (or EOS
when it has none). The model reads ``ctx + cont`` without its last token, cut from the left to
``max_length`` tokens; the last ``len(cont)`` positions predict ``cont``.

Token geometry: the logit predicting ``cont[0]`` comes from the context's last token, so an item's
shared prefix is the context minus its last token (the same for every choice of a question: it
runs once per batch or comes from the prefix cache) and its own tokens are the context's last
token followed by ``cont[:-1]``; every one of them predicts a continuation token.

Output: ``scores/`` Parquet shards keyed by id (`load_scores`), and per question acc and acc_norm
(`load_questions`; written to ``questions.parquet`` and summed up in the report at the end).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import numpy as np

from forge.batching.memory import CostModel
from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item
from forge.inputs import Column, InputFile, Row, first_line, short, string_problem, unencodable
from forge.run import Rejected, Skipped
from forge.schema import positive
from forge.store import RunStore
from forge.tables import TableWriter, load_table
from forge.functions.probe_gen import DTYPES, InputSpec, ModelSpec, ProbeGen, resolve_input, resolve_model_source

SUBDIR = "scores"
QUESTIONS = "questions.parquet"
TOKEN_RULE = "lm-eval encode_pair: trailing context whitespace to continuation; cont = enc(ctx+cont)[len(enc(ctx)):] (v1)"
DEFAULT_MAX_LENGTH = 2048  # lm-eval's when the model's config names no maximum
COLUMNS = {"context": Column(required=True), "continuation": Column(), "id": Column(kinds=("string", "integer"))}
# the logits are float32 [tokens, vocab] three times over (head output cast, log_softmax, argmax scratch)
LOGIT_COPIES = 3


@dataclass
class ScoreConfig:
    """The root keys score reads (its constructor's parameters), checked at the edge."""

    model: ModelSpec = field(default_factory=ModelSpec)
    input: InputSpec = field(default_factory=InputSpec)
    target_delimiter: str = " "  # multiple choice: continuation = target_delimiter + choice (lm-eval's default)
    add_special_tokens: bool = True  # the tokenizer's own start tokens (BOS) before every context
    max_length: Optional[int] = positive(None)  # tokens the model reads; null: the model's maximum
    shard_size: int = positive(4096)


@dataclass(slots=True)
class ScoreMeta:
    """What an item carries besides its token ids (opaque to Forge, read by the worker and sink)."""

    targets: tuple[int, ...]  # the continuation's token ids, predicted by the item's last len(targets) tokens
    question: str  # the row's id (a multiple-choice question, or the plain row itself)
    choice: int  # index among the question's choices; -1 for a plain row
    num_choices: int  # choices of the question; 1 for a plain row
    gold: int  # the correct choice; -1 when the row names none
    num_bytes: int  # UTF-8 bytes acc_norm divides by: the choice (no delimiter), or the continuation
    truncated: int  # context tokens cut from the left to fit max_length


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("question", pa.string()), ("choice", pa.int32()), ("num_choices", pa.int32()),
        ("gold", pa.int32()), ("loglik", pa.float64()), ("num_tokens", pa.int32()), ("greedy", pa.bool_()),
        ("num_bytes", pa.int32()), ("truncated", pa.int32()), ("index", pa.int64()),
    ])


class Score(ProbeGen):
    """Reuses ProbeGen's model description (config, tokenizer, capabilities, mode checks, model
    loading); its items, worker and output are its own. It keeps one hidden state: the final one."""

    name = "score"
    config_schema = ScoreConfig

    def __init__(self, model: dict, input: dict, target_delimiter: str = " ", add_special_tokens: bool = True,
                 max_length: int | None = None, shard_size: int = 4096, too_long: str = "skip"):
        from forge.runtime.hf_compat import num_layers

        self.model = ModelSpec(**model)
        if self.model.torch_dtype not in DTYPES:
            raise ForgeError(f"model.torch_dtype={self.model.torch_dtype!r}; choose one of {', '.join(DTYPES)}")
        if too_long == "truncate":
            raise ForgeError("too_long=truncate cuts items from the right, which would cut the continuation; "
                             "score cuts contexts from the left at max_length itself: use too_long=skip or error")
        self.target_delimiter = str(target_delimiter)
        self.add_special_tokens = bool(add_special_tokens)
        self.shard_size = int(shard_size)
        self.input = InputFile(resolve_input(str(input["path"])), input, COLUMNS)  # refuses a bad input now
        self.input_path, self.input_limit = self.input.path, self.input.limit
        self.source = resolve_model_source(self.model.name)
        self._model_path: str | None = None
        self._warnings: list[str] = []
        self._prefixes: dict = {}
        self._config = None
        self._tokenizer = None
        self._encoder: _Encoder | None = None
        self.pooling = "last"
        self.layers = [num_layers(self.config)]  # the final hidden state, which the LM head reads
        self.max_length = int(max_length) if max_length else self._model_max_length()
        self.caps = self._capabilities()
        self.causal = self.caps.causal
        self._mode = (True, False, True)

    def _model_max_length(self) -> int:
        """lm-eval's rule: the config's maximum positions, else the tokenizer's, else 2048."""
        from forge.runtime.hf_compat import text_config

        cfg = text_config(self.config)
        for key in ("n_positions", "max_position_embeddings", "n_ctx"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        value = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(value, int) and 0 < value < 1 << 30:
            return value
        return DEFAULT_MAX_LENGTH

    # -- description --------------------------------------------------------------
    def cost_model(self) -> CostModel:
        """The decoder's measured (or estimated) model, plus the float32 logits of every row token
        (each of them predicts a continuation token; the head runs in chunks, so this is an upper bound)."""
        from forge.runtime.hf_compat import text_config

        base = super().cost_model()
        vocab = int(getattr(text_config(self.config), "vocab_size", 0) or 0)
        per_token = vocab * (DTYPES[self.model.torch_dtype] + 4 * LOGIT_COPIES)
        return replace(base, bytes_per_token=base.bytes_per_token + per_token)

    def fingerprint(self) -> dict[str, Any]:
        fp = super().fingerprint()
        for key in ("layers", "pooling"):
            fp.pop(key, None)
        fp.update(token_rule=TOKEN_RULE, target_delimiter=self.target_delimiter,
                  add_special_tokens=self.add_special_tokens, max_length=self.max_length)
        return fp

    def expected_items(self) -> int | None:
        return None  # multiple-choice rows expand to several items: unknown until read

    def worker_modules(self) -> list[str]:
        return [*super().worker_modules(), __name__, "forge.runtime.scoring"]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_encoder"] = None
        return state

    # -- items --------------------------------------------------------------------
    @property
    def encoder(self) -> "_Encoder":
        if self._encoder is None:
            self._encoder = _Encoder(self.tokenizer, self.add_special_tokens)
            if self._encoder.dropped_eos:
                self._warnings.append("the tokenizer appends EOS to every text: score drops it (it would sit "
                                      "between context and continuation)")
        return self._encoder

    def records(self) -> Iterator[Item | Rejected | Skipped]:
        counter = 0  # every item's commit key, in input order: the same on every read of the same input
        truncated = 0
        for row in self.input.rows():
            if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
                yield row
                continue
            parsed = self._parse_row(row)
            if isinstance(parsed, Rejected):
                yield parsed
                continue
            context, continuations, gold, norm_texts = parsed
            try:
                made = self._items(row, context, continuations, gold, norm_texts)
            except ForgeError:
                raise
            except Exception as exc:  # noqa: BLE001  (a row the tokenizer cannot take fails alone)
                made = [f"tokenizing failed on it ({first_line(exc)}); fix or drop the row"]
            if isinstance(made[0], str):
                yield row.reject(made[0])
                continue
            for item in made:
                item.index = counter
                counter += 1
                truncated += item.meta.truncated > 0
                yield item
        note = (f"{truncated} item(s) read more than max_length={self.max_length} tokens: their contexts were "
                "cut from the left (column 'truncated' counts the tokens)")
        if truncated and note not in self._warnings:
            self._warnings.append(note)

    def _parse_row(self, row: Row):
        """(context, continuations, gold, texts acc_norm measures) or a Rejected naming the fix."""
        data = row.data
        problem = string_problem(data, "context", required=True, empty_ok=True)
        if problem is not None:
            return row.reject(problem)
        context, continuation, choices = data["context"], data.get("continuation"), data.get("choices")
        if (continuation is None) == (choices is None):
            what = "has both 'continuation' and 'choices'" if choices is not None else "has no 'continuation'"
            return row.reject(f"{what}; give a string 'continuation', or a list 'choices' with 'gold'")
        if choices is not None:
            if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c
                                                                               for c in choices):
                return row.reject(f"'choices' must be a non-empty list of non-empty strings, got {short(choices)}")
            gold = data.get("gold")
            if gold is not None and (isinstance(gold, bool) or not isinstance(gold, int)
                                     or not 0 <= gold < len(choices)):
                return row.reject(f"'gold' is {short(gold)}, not a choice index 0..{len(choices) - 1}; "
                                  "fix it or leave it out")
            continuations = [self.target_delimiter + c for c in choices]
            norm = list(choices)
            gold = -1 if gold is None else gold
        else:
            if not isinstance(continuation, str) or not continuation:
                return row.reject(f"has an empty or non-string 'continuation' ({short(continuation)}); "
                                  "it needs at least one character")
            continuations, norm, gold = [continuation], [continuation], -1
        for k, value in enumerate(continuations):
            bad = unencodable(value)
            if bad is not None:
                return row.reject(f"'continuation {k}' holds an unpaired surrogate (\\u{ord(value[bad]):04x} at "
                                  f"position {bad}); write the character whole or drop it")
        return context, continuations, gold, norm

    def _items(self, row: Row, context: str, continuations: list[str], gold: int,
               norm_texts: list[str]) -> list[Item] | list[str]:
        """The row's items (one per continuation), or [why it cannot have them]."""
        multiple_choice = row.data.get("choices") is not None
        made: list[Item] = []
        for choice, continuation in enumerate(continuations):
            item = self._item(row.id, choice if multiple_choice else -1, len(continuations), gold, context,
                              continuation, norm_texts[choice])
            if isinstance(item, str):
                return [item]
            made.append(item)
        return made

    def _item(self, qid: str, choice: int, num_choices: int, gold: int, context: str, continuation: str,
              norm_text: str) -> Item | str:
        """One item, or why it cannot be one."""
        ctx, cont = self.encoder.pair(context, continuation)
        if not cont:
            return f"continuation {continuation!r} has no tokens of its own after the context"
        if len(cont) > self.max_length:
            return (f"continuation {continuation[:30]!r}... has {len(cont)} tokens, more than max_length="
                    f"{self.max_length}; shorten it or raise max_length")
        run = ctx + cont[:-1]  # what the model reads
        cut = max(0, len(run) - self.max_length)
        run = run[cut:]
        prefix_len = len(run) - len(cont)  # the context minus its last token (the rest predicts cont)
        key = _prefix_key(run[:prefix_len]) if prefix_len > 0 else None
        iid = qid if choice < 0 else f"{qid}/{choice}"
        meta = ScoreMeta(tuple(cont), qid, choice, num_choices, gold, len(norm_text.encode("utf-8")), cut)
        return Item(iid, len(run), key, prefix_len, run, meta)

    # -- running ------------------------------------------------------------------
    def open_worker(self, device: Device, cache_tokens: int) -> "ScoreWorker":
        from forge.runtime.scoring import ScoreRunner

        loaded = super().open_worker(device, cache_tokens)  # the model, in a CausalLMRunner
        return ScoreWorker(ScoreRunner(loaded.runner))

    def open_sink(self, store: RunStore) -> "ScoreSink":
        return ScoreSink(TableWriter(store, SUBDIR, _schema(), self.shard_size))


class _Encoder:
    """lm-eval's encoding of (context, continuation) with one tokenizer."""

    def __init__(self, tokenizer, add_special_tokens: bool):
        self.tok = tokenizer
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a", add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        self.start = list(full[:at]) if add_special_tokens else []  # what precedes every text (BOS)
        self.dropped_eos = add_special_tokens and len(full) > at + len(plain)
        bos = tokenizer.bos_token_id
        self.empty_context = [bos if bos is not None else tokenizer.eos_token_id]

    def enc(self, text: str) -> list[int]:
        return self.start + list(self.tok(text, add_special_tokens=False)["input_ids"])

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.enc(context) if context else []
        if not ctx:  # nothing to predict the first token from: the BOS (or EOS) stands in
            return list(self.empty_context), list(self.tok(continuation, add_special_tokens=False)["input_ids"])
        whole = self.enc(context + continuation)
        return ctx, whole[len(ctx):]


def _prefix_key(tokens: list[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:16]


class ScoreWorker:
    def __init__(self, runner):
        self.runner = runner

    def run(self, batch: Batch):
        return self.runner.run(batch)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.runner = None


class ScoreSink:
    """Score rows into Parquet shards; at close, acc and acc_norm per question over every committed row."""

    def __init__(self, writer: TableWriter):
        self.writer = writer
        self.rows_per_shard = writer.rows_per_shard

    def write(self, batch: Batch, output, keep: list[bool] | None) -> None:
        items = batch.items
        loglik, counts, greedy = output.loglik, output.num_tokens, output.greedy
        if keep is not None:
            items = [it for it, k in zip(items, keep) if k]
            loglik, counts, greedy = loglik[keep], counts[keep], greedy[keep]
        metas = [it.meta for it in items]
        self.writer.add(id=[it.id for it in items], question=[m.question for m in metas],
                        choice=[m.choice for m in metas], num_choices=[m.num_choices for m in metas],
                        gold=[m.gold if m.gold >= 0 else None for m in metas],
                        loglik=[float(x) for x in loglik], num_tokens=[int(x) for x in counts],
                        greedy=[bool(x) for x in greedy], num_bytes=[m.num_bytes for m in metas],
                        truncated=[m.truncated for m in metas], index=[it.index for it in items])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> dict[str, Any]:
        out = self.writer.close()
        store = self.writer.store
        questions = question_table(load_scores(store.url()))
        if questions.num_rows:
            import pyarrow as pa
            import pyarrow.parquet as pq

            buffer = pa.BufferOutputStream()
            pq.write_table(questions, buffer)
            store.write_file(QUESTIONS, buffer.getvalue().to_pybytes())  # replaced whole (a local path or a URL)
            out["questions"] = store.url(QUESTIONS)
        out["accuracy"] = accuracy(questions)
        return out


# -- reading results ------------------------------------------------------------------


def load_scores(run_dir):
    """Every committed score row of a run (pyarrow Table, input order): id, question, choice,
    num_choices, gold, loglik, num_tokens, greedy, num_bytes, truncated, index."""
    table = load_table(run_dir, SUBDIR)
    return table if table is not None else _schema().empty_table()


def question_table(scores):
    """Per multiple-choice question with a gold index and every choice scored: pred (argmax of
    loglik), pred_norm (argmax of loglik / num_bytes), acc, acc_norm (ties: the first choice,
    as numpy's argmax in lm-eval)."""
    import pyarrow as pa

    cols = {name: scores.column(name).to_pylist() for name in ("question", "choice", "num_choices", "gold",
                                                               "loglik", "num_bytes")}
    by_question: dict[str, dict[int, tuple[float, int]]] = {}
    info: dict[str, tuple[int, int]] = {}
    for q, c, k, g, ll, nb in zip(*cols.values()):
        if c < 0 or g is None:
            continue
        by_question.setdefault(q, {})[c] = (ll, nb)
        info[q] = (k, g)
    out: dict[str, list] = {"question": [], "num_choices": [], "gold": [], "pred": [], "pred_norm": [],
                            "acc": [], "acc_norm": []}
    for q, got in by_question.items():
        k, gold = info[q]
        if len(got) != k:
            continue  # a choice failed or is not committed yet: no answer for this question
        ll = np.array([got[c][0] for c in range(k)])
        nb = np.array([max(got[c][1], 1) for c in range(k)], dtype=np.float64)
        pred, pred_norm = int(np.argmax(ll)), int(np.argmax(ll / nb))
        for name, value in (("question", q), ("num_choices", k), ("gold", gold), ("pred", pred),
                            ("pred_norm", pred_norm), ("acc", float(pred == gold)), ("acc_norm", float(pred_norm == gold))):
            out[name].append(value)
    return pa.table(out, schema=pa.schema([("question", pa.string()), ("num_choices", pa.int32()),
                                           ("gold", pa.int32()), ("pred", pa.int32()), ("pred_norm", pa.int32()),
                                           ("acc", pa.float64()), ("acc_norm", pa.float64())]))


def accuracy(questions) -> dict[str, Any]:
    """Mean acc and acc_norm over the questions (None without any)."""
    n = questions.num_rows
    if not n:
        return {"questions": 0, "acc": None, "acc_norm": None}
    acc = np.asarray(questions.column("acc").to_pylist())
    norm = np.asarray(questions.column("acc_norm").to_pylist())
    return {"questions": n, "acc": round(float(acc.mean()), 6), "acc_norm": round(float(norm.mean()), 6)}


def load_questions(run_dir):
    """acc and acc_norm per multiple-choice question of a run (pyarrow Table), from its scores."""
    return question_table(load_scores(run_dir))

