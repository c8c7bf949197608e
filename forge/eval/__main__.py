"""`python -m forge.eval ARGS`: lm-eval's command line, with `--model forge` registered."""

from forge.eval.cli import main

if __name__ == "__main__":
    main()
