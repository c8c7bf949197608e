"""Hydra discovers plugins in the `hydra_plugins` namespace package: this one puts installed
Forge plugins' config directories on the search path, and serves the functions' and batching
modes' schemas (see forge/cli/searchpath.py)."""

from forge.cli.searchpath import ForgeSearchPathPlugin, SchemaSource

__all__ = ["ForgeSearchPathPlugin", "SchemaSource"]
