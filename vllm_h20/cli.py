"""The `vllm-h20` command line.

Exit codes scripts can rely on: 0 success; 1 a check failed (verify found a mismatch);
2 bad input or usage (the one-line message says which file/tensor/key and what to do);
130 interrupted.
"""

from __future__ import annotations

import os

import click

from . import __version__
from .convert import cli as convert_cli
from .exits import UserErrorGroup


@click.group(
    cls=UserErrorGroup,
    user_errors=convert_cli.user_errors,
    interrupt_hint="interrupted; rerun with --resume to continue",
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="vllm-h20")
def main() -> None:
    """Serve DeepSeek-V4.1-class MXFP4 MoE models fast on NVIDIA H20 with vLLM.

    \b
    Typical flow:
      vllm-h20 convert /models/DeepSeek-V4.1-Flash /models/DeepSeek-V4.1-Flash-FP8
      vllm-h20 verify  /models/DeepSeek-V4.1-Flash /models/DeepSeek-V4.1-Flash-FP8
      vllm-h20 demo    # the whole conversion on a small generated checkpoint
    """


def _register_subgroups() -> None:
    from .bench.cli import bench
    from .moe.cli import kernels, patches
    from .serve.cli import plan_cmd, recipe, serve

    for name in convert_cli.COMMANDS:
        main.add_command(getattr(convert_cli, name))
    main.add_command(kernels)
    main.add_command(patches)
    main.add_command(recipe)
    main.add_command(plan_cmd)
    main.add_command(serve)
    main.add_command(bench)


_register_subgroups()


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
