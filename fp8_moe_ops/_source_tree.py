"""Import shim for running from a source checkout.

The graph pass lives in the top-level ``passes/`` folder and is *installed* as
``fp8_moe_ops.passes`` (``[tool.setuptools.package-dir]`` in pyproject.toml).  When
Python imports ``fp8_moe_ops`` from the checkout itself -- the current directory is
the repository root, which comes first on ``sys.path`` -- the source folder
``fp8_moe_ops/`` shadows the installed package and has no ``passes``.  This finder
maps exactly that one name to ``<checkout>/passes`` in that case, so
``import fp8_moe_ops.passes`` and ``python -m fp8_moe_ops demo`` work from the
repository root after an editable or a non-editable install alike.  It is appended
to ``sys.meta_path`` (asked last) and is never installed for an installed package.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_NAME = "fp8_moe_ops.passes"


class _PassesFinder(importlib.abc.MetaPathFinder):
    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME:
            return None
        return importlib.util.spec_from_file_location(
            _NAME, self.folder / "__init__.py", submodule_search_locations=[str(self.folder)])


def install_if_checkout() -> None:
    """Register the finder when this package was imported from a checkout's ``fp8_moe_ops/``."""
    package_dir = Path(__file__).resolve().parent
    root = package_dir.parent
    passes = root / "passes"
    in_checkout = (root / "pyproject.toml").is_file() and (passes / "__init__.py").is_file()
    if not in_checkout or (package_dir / "passes").exists():
        return
    if not any(isinstance(f, _PassesFinder) for f in sys.meta_path):
        sys.meta_path.append(_PassesFinder(passes))
