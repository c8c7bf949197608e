"""Where `forge.functions`, `forge.builtin` and `forge.conf` come from.

Installed (a wheel or `pip install -e .`), setuptools maps the repository's top-level
`functions/`, `plugins/` and `conf/` to these subpackages of `forge` (`package-dir` in
pyproject.toml), so nothing claims a generic top-level name in site-packages.

Model: in a source checkout (a `pyproject.toml` beside `forge/`, and no `forge/functions/`)
the checkout whose `forge/` was imported also provides the three subpackages, through a
finder placed ahead of any installed one. So a worktree run from its root uses its own
`functions/`, never those of another checkout that happens to be installed in editable mode.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path

SOURCE_DIRS = {"forge.functions": "functions", "forge.builtin": "plugins", "forge.conf": "conf"}


class SourceCheckoutFinder(MetaPathFinder):
    """Finds the three mapped subpackages in one checkout's root directory."""

    def __init__(self, root: Path):
        self.root = root  # the checkout: holds forge/, functions/, plugins/, conf/

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        folder = SOURCE_DIRS.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init,
                                                      submodule_search_locations=[str(init.parent)])


def install(package_dir: Path) -> None:
    """Put a SourceCheckoutFinder first on sys.meta_path when `package_dir` (forge/) sits in a
    source checkout; an installed forge holds the subpackages itself and needs none."""
    root = package_dir.parent
    if (package_dir / "functions").is_dir() or not (root / "pyproject.toml").is_file():
        return
    if not (root / "functions" / "__init__.py").is_file():
        return
    if any(isinstance(f, SourceCheckoutFinder) and f.root == root for f in sys.meta_path):
        return
    sys.meta_path.insert(0, SourceCheckoutFinder(root))
