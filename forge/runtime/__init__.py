"""Torch-side runtime: running Forge batches through models. One subpackage per concern, bottom
first: a subpackage imports its own modules and those of the subpackages listed before it, never
one listed after it (`tests/import_map.py`, `RUNTIME_ROOMS`):

- `model/`: what a model is, read without running it (specs, class facts, capabilities, version shims);
- `tokens/`: how a row's prompts become items (the token rule, prompts to items);
- `hooks/`: hook points, and the interventions applied there (per run and per row);
- `forward/`: forward runners (causal LM, encoder), their layouts, the prefix cache, item views;
- `cost/`: what a batch costs a device (the measured memory model, cost models, step time);
- `placement/`: where a model's layers go over a device group, and whether the devices exist;
- `decoder/`: generation (continuous batching under a step budget and a KV budget).
"""
