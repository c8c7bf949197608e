"""Forge's built-in plugins. They register through the `forge` entry-point group, exactly
as a third-party plugin does (see pyproject.toml)."""
