"""Forward runners: a batch through a causal LM (`causal_lm.py`) or an encoder (`encoder.py`) in any
layout (rows, shared prefixes, packed rows, trees), and what comes back: pooled states, scores,
item views. `request.py` says what a function asks of the forward pass; `reference.py` is the
one-item ground truth the tests compare with."""
