"""Tests of the runnable benchmarks under benchmarks/ (scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """A benchmark script as a module under `name`: several benchmark folders have a stage.py
    or report.py, and sys.modules keeps the first one imported under a shared name."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
