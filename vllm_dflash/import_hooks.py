# SPDX-License-Identifier: Apache-2.0
"""Run a callback right after a module is imported (a post-import hook).

The plugin is loaded in every vLLM process, but most patches change modules
that only some processes import (the model runner in workers, the scheduler in
the engine core). Deferring each such patch to the import of its module keeps
the API server from importing the model runner at all: no start-up cost where
nothing needs the patch, and the patch is in place before anyone can use the
module. A module that is already imported runs its callbacks at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

from typing_extensions import override

_lock = threading.Lock()


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the module's callbacks."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    @override
    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._name)

    def __getattr__(self, attr: str):  # e.g. get_source, is_package
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of modules that have callbacks waiting."""

    @override
    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


_waiting: dict[str, list[Callable[[], None]]] = {}
_finder = _PostImportFinder()


def _run(name: str) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
    for callback in callbacks:
        callback()


def when_imported(name: str, callback: Callable[[], None]) -> bool:
    """Call ``callback()`` once ``name`` is imported; at once if it already is.

    Returns True when the callback ran now, False when it waits."""
    with _lock:
        if name not in sys.modules:
            _waiting.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return False
    callback()
    return True


def waiting() -> dict[str, int]:
    """Module name -> number of callbacks still waiting (for diagnostics)."""
    with _lock:
        return {k: len(v) for k, v in _waiting.items()}
