"""lm-eval's `generate_until` on Forge's `generate` function (`forge.eval.lm.ForgeLM`).

Requests that share their generation arguments run together, one Forge run per distinct set:
`until` becomes each row's `stop`, `max_gen_toks` the run's `max_new_tokens`, and `do_sample`
with `temperature` its sampling (greedy unless both ask for sampling). The text is cut before
the first stop string, as lm-eval's own models cut it.

Each context is encoded here as lm-eval's HF model encodes it (`HFLM.tok_batch_encode`: the
tokenizer's special tokens, unless the text starts with its BOS text already, as a chat template's
output does) and cut from the left to `max_length - max_gen_toks` tokens; the run reads those
ids (`prompt_ids`), so a context longer than the model runs as HF runs it."""

from __future__ import annotations

import json
from typing import Any

from forge.errors import ForgeError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default max_gen_toks


def generate_all(lm: Any, requests: list) -> list[str]:
    groups: dict[str, list[int]] = {}
    for n, request in enumerate(requests):
        groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(n)
    texts = [""] * len(requests)
    if not requests:
        return texts
    score = lm.score_function()  # the model's tokenizer and lm-eval's max_length
    for k, members in enumerate(groups.values()):
        until, overrides = generation_overrides(dict(requests[members[0]].args[1]))
        keep = score.max_length - max_new_tokens(overrides)
        if keep <= 0:
            raise ForgeError(
                f"generate_until: max_gen_toks ({max_new_tokens(overrides)}) is not less than max_length "
                f"({score.max_length}); raise max_length in --model_args or lower max_gen_toks"
            )
        contexts = [requests[n].args[0] for n in members]
        ids = context_ids(score.tokenizer, contexts, keep)
        rows = [{"id": n, "prompt": c, "prompt_ids": i, "stop": until} for n, c, i in zip(members, contexts, ids)]
        result = lm.run("generate", rows, f"generate_until-{k}", overrides)
        found = dict(zip(result.ids, result.tensors["text"]))
        for n in members:
            if str(n) not in found:
                raise ForgeError(f"generate_until: request {n} has no generation; see {result.run_dir}")
            texts[n] = cut(str(found[str(n)]), until)
    return texts


def generation_overrides(kwargs: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the stop strings, the generate run's overrides) of one request's generation arguments."""
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    # lm-eval's aliases, by its priority (normalize_gen_kwargs)
    limit = next((kwargs.pop(k) for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if k in kwargs), None)
    overrides = [f"max_new_tokens={int(DEFAULT_MAX_GEN_TOKS if limit is None else limit)}"]
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if kwargs.pop("do_sample", False) and temperature > 0:
        overrides.append(f"sampling.temperature={temperature}")
    return until, overrides


def max_new_tokens(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("max_new_tokens=")).split("=", 1)[1])


def context_ids(tok: Any, contexts: list[str], keep: int) -> list[list[int]]:
    """Each context's token ids as lm-eval's HF model makes them for generation: with the
    tokenizer's special tokens unless the text starts with its BOS text, the last `keep` of them."""
    bos = getattr(tok, "bos_token", None)
    starts = [bool(bos) and c.startswith(bos) for c in contexts]
    out: list[list[int]] = [[] for _ in contexts]
    for special in (True, False):
        picked = [n for n, s in enumerate(starts) if s != special]
        if picked:
            encoded = tok([contexts[n] for n in picked], add_special_tokens=special)["input_ids"]
            for n, ids in zip(picked, encoded):
                out[n] = list(ids)[-keep:]
    return out


def cut(text: str, until: list[str]) -> str:
    """The text before the first stop string."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
