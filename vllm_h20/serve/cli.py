"""`vllm-h20 recipe check`, `vllm-h20 plan`, `vllm-h20 serve`."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import click

from ..console import make_console
from ..exits import EXIT_CHECK_FAILED
from ..exits import fail as _fail
from .recipe import RecipeError

GIB = 1 << 30


def _checked(file: str):
    from . import check, recipe

    try:
        r = recipe.load(file)
        return r, check.check(r)
    except RecipeError as e:
        _fail(str(e))


@click.group()
def recipe() -> None:
    """Serving recipes: `vllm serve --config` files (recipes/*.yaml or your own)."""


@recipe.command("check")
@click.argument("files", nargs=-1, required=True)
def recipe_check(files) -> None:
    """Validate recipes with the installed vLLM's own parser and config classes.

    FILE is a path or the name of a shipped recipe. Unknown flags or nested keys, wrong
    types and conflicts (EPLB without expert parallelism, redundant experts without EPLB, a
    nested `config`) are one line naming file:line: key. Exit 0 when all are valid."""
    for f in files:
        r, res = _checked(f)
        click.echo(f"ok: {r.path}: {res.flags} flags valid for vLLM {res.vllm}")


_gpu_opt = click.option(
    "--gpu",
    default="h20-96g",
    show_default=True,
    metavar="h20-96g|h20-141g|h200|h100|GIB",
    help="GPU memory per device, by name or in GiB.",
)


def _plan(r, res, model: Path, gpu: str, unknown_ok: bool = False):
    """The plan for a recipe already checked (`_checked`: vLLM's parser runs once); None when
    unknown_ok and the planner does not know the checkpoint's layout (it says so)."""
    from . import plan as plan_mod

    if not model.is_dir():
        _fail(f"{model}: not a directory; --model is the (converted) checkpoint directory")
    try:
        return plan_mod.plan(r, res.parsed, model, gpu)
    except plan_mod.NotPlannable as e:
        if not unknown_ok:
            _fail(str(e))
        click.echo(f"plan: skipped: {e}")
        return None
    except (RecipeError, ValueError) as e:
        _fail(str(e))


def _print_plan(p, contexts=(8192, 32768, 131072)) -> None:
    from rich.table import Table

    t = Table(title=f"per GPU: {p.gpu}, TP{p.tp} x EP{p.ep}", show_header=False)
    for k, v in p.weights.items():
        t.add_row(f"weights: {k}", f"{v / GIB:10.2f} GiB")
    t.add_row("[bold]weights[/]", f"[bold]{p.weights_total / GIB:10.2f} GiB[/]")
    for k, v in p.overheads.items():
        t.add_row(k, f"{v / GIB:10.2f} GiB")
    source = "GPU memory: kv-cache-memory-bytes set" if p.kv_fixed else "gpu-memory-utilization"
    t.add_row(f"budget ({source})", f"{p.budget / GIB:10.2f} GiB")
    t.add_row(
        "[bold]KV cache[/]", f"[bold]{p.kv_bytes / GIB:10.2f} GiB[/] = {p.kv_tokens:,} tokens"
    )
    for c in contexts:
        t.add_row(f"requests at {c:,}-token context", f"{p.concurrency(c):,}")
    if p.host_per_rank:
        t.add_row("pinned host memory (Engram)", f"{p.host_per_rank / GIB:.2f} GiB per GPU, "
                  f"{p.host_per_node / GIB:.1f} GiB per node")  # fmt: skip
    if p.slots_per_rank:
        t.add_row(
            "expert slots per rank", ", ".join(f"{k} {v}" for k, v in p.slots_per_rank.items())
        )
    make_console().print(t)


@click.command("plan")
@click.argument("file")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Checkpoint dir.")
@_gpu_opt
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout.")
def plan_cmd(file, model, gpu, as_json) -> None:
    """Memory per GPU for a recipe and a checkpoint, from its headers: weights by TP/EP
    (EPLB replicas included), runtime overheads (defaults from the seed's H20 profile), KV
    cache in GiB and tokens, concurrent requests per context, pinned host memory.

    Exit 0 when it fits, 1 when it does not (the numbers say by how much)."""
    p = _plan(*_checked(file), model, gpu)
    if as_json:
        click.echo(json.dumps(p.to_json(), indent=2))
    else:
        _print_plan(p)
        click.echo("fits" if p.fits else f"does not fit: {p.why}")
    sys.exit(0 if p.fits else EXIT_CHECK_FAILED)


def _last_flag(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv (vLLM: the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# SMs per GPU name of --gpu: the fix's kernel choice depends on it (H20's 78 SMs: threshold 64).
_SMS = {"h20-96g": 78, "h20-141g": 78, "h200": 132, "h100": 132}


def _precompile_fix(r, parsed: dict, model: Path, gpu: str, extra: list[str], dry_run: bool):
    """Compile the fix's DeepGEMM kernels for this model and recipe before vLLM starts; any
    reason not to (another MoE backend, the stock dispatch, no nvcc) is one line, never fatal:
    the kernels then compile at run time, as without vllm-h20."""
    from ..moe import dispatch
    from ..moe import precompile as pc
    from ..moe.patchfile import PatchError
    from .plan import parallelism

    backend = _last_flag(extra, "--moe-backend") or r.flags.get("moe-backend")
    if backend != "flashinfer_cutlass":
        return  # the fix is FlashInfer CUTLASS's kernel choice; other backends never run it
    tokens = _last_flag(extra, "--max-num-batched-tokens") or parsed.get("max_num_batched_tokens")
    _tp, dp, ep, redundant = parallelism(parsed)
    try:
        decision = dispatch.decide()
        if not decision.per_expert:
            raise pc.PrecompileError(decision.message.split(": ", 1)[-1])
        sms = _SMS.get(gpu)
        if sms is None:
            raise pc.PrecompileError(f"--gpu {gpu}: SM count unknown (use a GPU name)")
        shape = pc.shape_from_config(model / "config.json", ep, redundant)
        # With data-parallel attention the MoE layer sees every DP rank's step at once.
        rows = int(tokens or 8192) * (dp if ep > 1 else 1)
        pc.run(shape, sms, rows, None, make_console(stderr=True), dry_run=dry_run)
    except (pc.PrecompileError, dispatch.DispatchConfigError, PatchError, OSError) as e:
        click.echo(f"precompile: skipped: {e} (DeepGEMM compiles the kernels at run time)")


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("file")
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Checkpoint dir (else the recipe's `model`).")  # fmt: skip
@_gpu_opt
@click.option("--dry-run", is_flag=True, help="Check and plan, print the command, run nothing.")
@click.option("--force", is_flag=True, help="Start even when the plan says it will not fit.")
@click.option(
    "--precompile/--no-precompile", default=True, show_default=True,
    help="Before starting vLLM, compile the DeepGEMM kernels the fix can launch for this model "
    "and recipe (`vllm-h20 kernels precompile`), so that no request waits for one.",
)  # fmt: skip
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve(file, model, gpu, dry_run, force, precompile, extra) -> None:
    """Check the recipe, plan memory, then exec `vllm serve MODEL --config FILE [EXTRA...]`
    with the vllm-h20 plugin active (it is a vLLM general plugin: installed = active).

    \b
      vllm-h20 serve deepseek-v41-flash-fp8-tp8ep8 --model /models/V4.1-Flash-FP8
      vllm-h20 serve recipes/my.yaml --model /m -- --port 8001
    """
    from . import check

    r, res = _checked(file)
    try:
        check.check_argv(list(extra))
    except RecipeError as e:
        _fail(str(e))
    model = model or (Path(r.flags["model"]) if "model" in r.flags else None)
    if model is None:
        _fail(f"{r.path}: no model: pass --model DIR or set `model:` in the recipe")
    load_format = _last_flag(list(extra), "--load-format") or r.flags.get("load-format")
    p = None
    if load_format == "dummy":
        if not (model / "config.json").is_file():
            _fail(f"{model}: no config.json; with load-format dummy --model is a directory "
                  "holding the model's config.json and tokenizer")  # fmt: skip
        # Random weights: no checkpoint to read sizes from; vLLM measures memory at start.
        click.echo("plan: skipped: load-format dummy (random weights, no checkpoint to size)")
    else:
        p = _plan(r, res, model, gpu, unknown_ok=True)
    if p is not None:
        _print_plan(p)
        if not p.fits and not force:
            _fail(f"will not fit: {p.why} (see the plan above; --force starts anyway)",
                  EXIT_CHECK_FAILED)  # fmt: skip
    if precompile:
        _precompile_fix(r, res.parsed, model, gpu, list(extra), dry_run)
    vllm = shutil.which("vllm")
    argv = [vllm or "vllm", "serve", str(model), "--config", str(r.path), *extra]
    click.echo("$ " + shlex.join(argv))
    if dry_run:
        return
    if vllm is None:
        _fail("the `vllm` command is not on PATH (pip install vllm==0.33.0)")
    sys.stdout.flush()
    os.execvp(vllm, argv)
