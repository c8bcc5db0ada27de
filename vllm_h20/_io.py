"""Small file helpers shared by the commands that must never leave a half-written file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, doc: Any, indent: int | None = 2) -> None:
    """Write beside the target, fsync, rename: readers see the old file or the whole new one.
    indent=None: compact (the benchmarks' per-sample records, megabytes when indented)."""
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
