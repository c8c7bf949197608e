"""`ForgeLM`: an lm-eval model (`--model forge`) whose requests Forge runs, all at once.

Model: lm-eval hands a model its whole request list per kind. Each kind becomes one Forge run in
a `forge.Session` that lives as long as the model (its weights loaded once for every kind):

- `loglikelihood`: the `score` function on (context, continuation) rows; score encodes them by
  lm-eval's own rule (`_encode_pair`: the context's trailing space moves to the continuation)
  and cuts the context from the left to `max_length`, as lm-eval's HF model does;
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows over each text
  (`lm_eval.utils.get_rolling_token_windows`, `make_disjoint_window`), each conditioned on the
  tokens before it, scored as token-id rows; a text's log-likelihood is its windows' sum;
- `generate_until`: the `generate` function, one run per distinct set of generation arguments:
  `until` is `stop`, `max_gen_toks` is `max_new_tokens`, `do_sample`/`temperature` the sampling;
  the text ends before the first stop string, as lm-eval expects; each context is encoded as
  lm-eval's HF model encodes it and cut from the left to `max_length - max_gen_toks` tokens.

Chat templates (`--apply_chat_template`, `--system_instruction`, `--fewshot_as_multiturn`): lm-eval
renders each request through `apply_chat_template` (the tokenizer's template, as its HF model
calls it) before any request reaches the model; `tokenizer_name` and `chat_template` are HF's.

`--model_args` are Forge overrides (`model.name=...,budget.tokens_per_step=...,intervene=...`);
lm-eval splits them at commas, so `overrides=FILE.yaml` reads more from a YAML file (a list of
override strings, commas and all). `output_dir=DIR` keeps each kind's run directory under DIR,
so an evaluation stopped part way resumes (`resume=true` is added when one is there).
`batch_size` is ignored (one line says so): the token budget decides what runs together.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it imports them only into an empty registry)
from lm_eval import utils
from lm_eval.api.model import LM, TemplateLM
from lm_eval.api.registry import register_model

from forge.errors import ForgeError
from forge.inproc.session import Session

log = logging.getLogger(__name__)
IGNORED = ("batch_size", "max_batch_size", "device")  # lm-eval's own arguments a Forge run does not take


@register_model("forge")
class ForgeLM(LM):
    def __init__(self, overrides: str | None = None, output_dir: str | None = None, **model_args: Any) -> None:
        super().__init__()
        given = {k: model_args.pop(k) for k in IGNORED if k in model_args}
        if given.get("batch_size") not in (None, 1, "1"):
            log.warning(
                "forge: batch_size=%s is ignored; the token budget (budget.tokens_per_step) decides",
                given["batch_size"],
            )
        # score's own key (the others' functions have none): lm-eval's max_length, for the log-likelihoods
        max_length = model_args.pop("max_length", None)
        self.score_overrides = [] if max_length is None else [f"max_length={int(max_length)}"]
        self.overrides = [*_file_overrides(overrides), *(f"{k}={_text(v)}" for k, v in model_args.items())]
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.session = Session(self.overrides)
        self._score = None  # the score function built from the config: its tokenizer and max_length

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ForgeLM:
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> ForgeLM:
        """`--model_args` (as lm-eval parsed them) over lm-eval's own `--batch_size` and `--device`."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in IGNORED}
        return cls(**{**extra, **arg_dict})

    # -- the three request kinds ------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows = [{"id": n, "context": r.args[0], "continuation": r.args[1]} for n, r in enumerate(requests)]
        return self._scores(rows, "loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        score = self.score_function()
        tok, max_length = score.tokenizer, score.max_length
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        rows, owner = [], []
        for n, r in enumerate(requests):
            for ctx, cont in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=_encode(tok, r.args[0], prefix),
                    prefix_token=prefix,
                    max_seq_len=max_length,
                    context_len=1,
                ),
            ):
                rows.append({"id": len(rows), "context": "", "context_ids": ctx, "continuation_ids": cont})
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (loglik, _) in zip(owner, self._scores(rows, "loglikelihood_rolling")):
            totals[n] += loglik
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from forge.eval.generation import generate_all

        return generate_all(self, requests)

    # -- chat templates (lm-eval's HF model's) ----------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer, as the score function loads it."""
        return self.score_function().tokenizer

    @property
    def max_length(self) -> int:
        """lm-eval's max_length: the `max_length` model arg, else the model's maximum positions."""
        return int(self.score_function().max_length)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm-eval records with the results: the tokenizer's (TemplateLM's choice)."""
        return TemplateLM.chat_template(self, chat_template)  # type: ignore[arg-type]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat history as one prompt by the tokenizer's template; a template that refuses a
        system message gets the history without it (as lm-eval's HF model does)."""
        import jinja2

        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("forge: the chat template failed; applying it without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    # -- running ------------------------------------------------------------------------------
    def run(self, function: str, rows: list[dict], kind: str, overrides: list[str] = ()):
        """One Forge run of `function` over `rows` in the model's session (its run directory under
        output_dir/<kind> when output_dir is set: a stopped one resumes)."""
        if self.output_dir is None:
            return self.session.run(function, rows, overrides=list(overrides))
        out = self.output_dir / kind
        resume = ["resume=true"] if (out / "run.json").exists() else []
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / f"{kind}.jsonl"  # beside the run: the same input.path when it resumes
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return self.session.run(function, path, overrides=[*overrides, *resume], output_dir=out)

    def _scores(self, rows: list[dict], kind: str) -> list[tuple[float, bool]]:
        if not rows:
            return []
        result = self.run("score", rows, kind, self.score_overrides)
        found = dict(
            zip(result.tensors["question"], zip(result.tensors["loglik"].tolist(), result.tensors["greedy"].tolist()))
        )
        missing = [r["id"] for r in rows if str(r["id"]) not in found]
        if missing:
            raise ForgeError(
                f"{kind}: {len(missing)} request(s) have no score (first: {missing[0]}); see {result.run_dir}"
            )
        return [(float(found[str(r["id"])][0]), bool(found[str(r["id"])][1])) for r in rows]

    def score_function(self):
        """The score function as this model's config builds it (its tokenizer, its max_length)."""
        if self._score is None:  # composed as the loglikelihood runs compose it: once, kept by the session
            self._score = self.session.function("score", overrides=self.score_overrides)
        return self._score


def _encode(tok, text: str, prefix: int) -> list[int]:
    """lm-eval's HF `tok_encode` with its defaults: the tokenizer's special tokens, unless the text
    starts with the prefix token's text already."""
    starts = bool(text) and text.startswith(tok.decode([prefix]))
    return list(tok.encode(text, **({"add_special_tokens": False} if starts else {})))


def _file_overrides(path: str | None) -> list[str]:
    if path is None:
        return []
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ForgeError(
            f"model_args overrides={path}: cannot read it ({exc}); give a YAML list of overrides"
        ) from None
    if not isinstance(data, list) or not all(isinstance(o, str) for o in data):
        raise ForgeError(f"model_args overrides={path}: a YAML list of override strings, e.g. - intervene=[...]")
    return data


def _text(value: Any) -> str:
    """A value lm-eval parsed back to the text the command line had (True -> true)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
