"""What the journey's two precompile scripts (mhc_precompile.py, deepgemm_precompile.py) share:
reading the release's config.json with a one-line error, the flags that size their work
(the servers' batch-token limit, the compiling processes), and their JSON result's common
fields, so both stay in step."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def read_config(model: Path, prog: str) -> dict:
    """The checkpoint's config.json; an unreadable one ends the script naming the file."""
    try:
        return json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{prog}: cannot read {model / 'config.json'}: {e}") from None


def add_pool_args(ap: argparse.ArgumentParser) -> None:
    """--max-tokens and --workers, with the defaults both precompiles use."""
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=8192,
        help="the servers' max_num_batched_tokens (vLLM 0.26's default here: 8192)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, min(14, (os.cpu_count() or 2) - 2)),
        help="compiling processes (default: CPU count - 2, at most 14)",
    )


def write_json(a: argparse.Namespace, wall: float, **fields: Any) -> None:
    """The run's results at --json (if given): the model, the pool's size and the wall time,
    then the script's own fields."""
    if not a.json:
        return
    a.json.parent.mkdir(parents=True, exist_ok=True)
    head = {"model": str(a.model), "max_tokens": a.max_tokens, "workers": a.workers}
    a.json.write_text(json.dumps({**head, "wall_s": round(wall, 1), **fields}, indent=1))
