"""Run a function on a module right after it is imported, without importing it ourselves.

FlashInfer's `fused_moe.core` imports `gen_cutlass_fused_moe_sm90_module` by name and builds
the module on the first MoE call, so the replacement has to be installed on that module before
any MoE runs, yet importing it at plugin load would pull torch into vLLM's API server. A
one-shot meta-path finder wraps that module's loader and calls us once it has executed.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callback: Callback):
        self._inner = inner
        self._callback = callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._callback(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, fullname: str, callback: Callback):
        self.fullname = fullname
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the search below from finding us
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self.callback)
                return spec
        return None


def after_import(fullname: str, callback: Callback) -> None:
    """Call `callback(module)` once `fullname` is imported (now, if it already is)."""
    module = sys.modules.get(fullname)
    if module is not None:
        callback(module)
        return
    if not any(isinstance(f, _AfterImport) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(fullname, callback))
