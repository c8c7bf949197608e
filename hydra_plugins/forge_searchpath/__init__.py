"""Hydra discovers plugins in the `hydra_plugins` namespace package: this one puts installed
Forge plugins' config directories on the search path (see forge/config/searchpath.py)."""

from forge.config.searchpath import ForgeSearchPathPlugin

__all__ = ["ForgeSearchPathPlugin"]
