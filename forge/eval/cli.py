"""`forge eval ARGS` (and `python -m forge.eval ARGS`): import `forge.eval.lm`, which registers
`forge` as an lm-eval model, then run lm-eval's own command line on ARGS."""

from __future__ import annotations

import sys

import typer

from forge.errors import ForgeError

#: every argument goes to lm-eval's own parser, --help included
EVAL_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def eval_command(ctx: typer.Context) -> None:
    """lm-eval's command line with `--model forge` registered (`forge eval --model forge --tasks ...`)."""
    main(list(ctx.args))


def main(argv: list[str] | None = None) -> None:
    try:
        from lm_eval.__main__ import cli_evaluate

        import forge.eval.lm  # noqa: F401  (registers the model "forge")
    except ImportError as exc:
        raise SystemExit(f"error: forge eval needs lm-eval ({exc}); pip install lm-eval") from None
    saved = sys.argv
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except ForgeError as exc:
        raise SystemExit(f"error: {exc}") from None
    finally:
        sys.argv = saved
