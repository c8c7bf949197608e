"""Hydra discovers plugins in the `hydra_plugins` namespace package: this one puts installed
Forge plugins' config directories on the search path (see forge/cli/searchpath.py)."""

from forge.cli.searchpath import ForgeSearchPathPlugin

__all__ = ["ForgeSearchPathPlugin"]
