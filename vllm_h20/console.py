"""Rich consoles that do not wrap or truncate reports when output is piped or logged."""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 160


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH, soft_wrap=True)
