"""Model facts: where a function's model comes from (`spec.py`), the embedded default model
(`embedded.py`), what its class and config say it can do (`class_facts.py`, `capabilities.py`),
shims over transformers versions (`hf_compat.py`), loaded models kept across runs (`cache.py`)."""
