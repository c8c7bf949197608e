"""Forge's decoder: continuous batching of prompts under a step budget and a KV budget.

- `engine.py`: `Decoder`, the loop (schedule -> run -> update) and its KV budget;
- `sequence.py`: a sequence being generated, what a call did, where a step's tokens sit;
- `prefill.py`: blocks of prompts prefilled in parts (prefixes' KV kept in `forge.runtime.forward.prefix_cache`);
- `kv_slots.py`: the running sequences' keys and values, one slot each;
- decode steps read each shared prefix's KV once (`forge.runtime.forward.shared_prefix`);
- `sampling.py`: each row's own stream; `finish.py`: limits, stop strings, finish reasons;
- `fit.py`: what the decoder can run (the model refusal) and a step's memory;
- `worker.py`: a generative function's worker and sink (`forge.api.GenerativeFunction`).
"""
