"""Exit codes every `vllm-h20` command shares, and the one-line error that ends a command.

0 success; 1 a check failed (the command ran and the answer is no); 2 bad input or usage;
130 interrupted."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


def fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


class UserErrorGroup(click.Group):
    """A command group that ends a command with one `error:` line (exit 2) when it raises one of
    the group's bad-input exceptions, and (given an `interrupt_hint`: the top-level group) with
    that line and exit 130 on Ctrl-C. `user_errors` returns the exceptions when called, so a
    group imports its modules only when one of its commands runs."""

    def __init__(
        self,
        *args: Any,
        user_errors: Callable[[], tuple[type[Exception], ...]] = tuple,
        interrupt_hint: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.user_errors = user_errors
        self.interrupt_hint = interrupt_hint

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            if self.interrupt_hint is None:
                raise  # the enclosing group says it
            click.echo(self.interrupt_hint, err=True)
            sys.exit(130)
        except self.user_errors() as e:
            fail(str(e))
