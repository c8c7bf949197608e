"""lm-eval's `generate_until` on Forge's `generate` function (`forge.eval.lm.ForgeLM`).

Requests that share their generation arguments run together, one Forge run per distinct set:
`until` becomes each row's `stop`, `max_gen_toks` the run's `max_new_tokens`, and `do_sample`
with `temperature` its sampling (greedy unless both ask for sampling). The text is cut before
the first stop string, as lm-eval's own models cut it."""

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
    for k, members in enumerate(groups.values()):
        until, overrides = generation_overrides(dict(requests[members[0]].args[1]))
        rows = [{"id": n, "prompt": requests[n].args[0], "stop": until} for n in members]
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
    overrides = [f"max_new_tokens={int(kwargs.pop('max_gen_toks', DEFAULT_MAX_GEN_TOKS))}"]
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if kwargs.pop("do_sample", False) and temperature > 0:
        overrides.append(f"sampling.temperature={temperature}")
    return until, overrides


def cut(text: str, until: list[str]) -> str:
    """The text before the first stop string."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
