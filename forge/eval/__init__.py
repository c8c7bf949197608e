"""lm-evaluation-harness on Forge: `ForgeLM` (`lm.py`), lm-eval's `--model forge`, and `forge eval`
/ `python -m forge.eval`, lm-eval's own command line with it registered (docs/lm-eval.md).
lm-eval is an optional extra (`pip install lm-eval`); nothing here imports it until it is used."""
