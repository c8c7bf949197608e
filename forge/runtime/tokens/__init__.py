"""Rows to tokens: the token rule (`token_rule.py`: a (prefix, text) pair's ids, the same in every
batching mode) and prompts to items (`prompts.py`: batched tokenization, each item's targets)."""
