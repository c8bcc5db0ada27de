"""Exit codes every `vllm-h20` command shares, and the one-line error that ends a command.

0 success; 1 a check failed (the command ran and the answer is no); 2 bad input or usage;
130 interrupted."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


def fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)
