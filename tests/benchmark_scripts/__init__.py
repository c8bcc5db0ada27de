"""Tests of the runnable benchmarks under benchmarks/ (scripts, not a package)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import sys
import tarfile
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


def pack_published(published: Path, tarball: Path) -> Path:
    """A published result folder's check/, sweeps/, logs/ and steptime/ as the tarball
    `h200.sh collect` returns: what report.py reads to rebuild the folder."""
    with tarfile.open(tarball, "w:gz") as t:
        for sub in ("check", "sweeps", "logs", "steptime"):
            if (published / sub).exists():
                t.add(published / sub, arcname=sub)
        # The engines' step logs, published one gzipped file per server, as the servers wrote
        # them: one folder per server.
        for log in sorted(published.glob("steps/*.jsonl.gz")):
            body = gzip.decompress(log.read_bytes())
            info = tarfile.TarInfo(f"steps/{log.name.removesuffix('.jsonl.gz')}/steps-0.jsonl")
            info.size = len(body)
            t.addfile(info, io.BytesIO(body))
    return tarball
