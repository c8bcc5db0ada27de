"""Rich consoles that do not wrap or truncate reports when output is piped or logged."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

PIPE_WIDTH = 160


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH, soft_wrap=True)


def byte_progress(console: Console, disable: bool = False) -> Progress:
    """A progress bar over bytes with rate and ETA (tasks name themselves)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


def step_progress(console: Console, disable: bool = False) -> Progress:
    """A progress bar over build steps (compiled objects) with elapsed time and ETA."""
    from rich.progress import MofNCompleteColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[current]}", style="dim"),
        console=console,
        disable=disable,
    )
