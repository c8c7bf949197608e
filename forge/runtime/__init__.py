"""Torch-side runtime: running Forge batches through models."""
