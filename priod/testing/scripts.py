"""The checkout's scripts (``scripts/*.py``) imported as modules, so tests can call their parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_script"]


def import_script(path: str | Path, name: str) -> ModuleType:
    """Import the script at ``path`` as module ``name`` (registered in ``sys.modules``: its
    dataclasses look their module up while the class is built). A script already imported under
    that name is returned as it is."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
