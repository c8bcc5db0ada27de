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
from .recipe import GPUS_PER_NODE, RecipeError

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


def _plan(r, res, model: Path, gpu: str, unknown_ok: bool = False,
          gpus_per_node: int = GPUS_PER_NODE):  # fmt: skip
    """The plan for a recipe already checked (`_checked`: vLLM's parser runs once); None when
    unknown_ok and the planner does not know the checkpoint's layout (it says so)."""
    from . import plan as plan_mod

    if not model.is_dir():
        _fail(f"{model}: not a directory; --model is the (converted) checkpoint directory")
    try:
        return plan_mod.plan(r, res.parsed, model, gpu, gpus_per_node=gpus_per_node)
    except plan_mod.NotPlannable as e:
        if not unknown_ok:
            _fail(str(e))
        click.echo(f"plan: skipped: {e}")
        return None
    except (RecipeError, ValueError) as e:
        _fail(str(e))


CONTEXTS = (8192, 32768, 131072)


def _layout(p) -> str:
    dp = f" x DP{p.dp}" if p.dp > 1 else ""
    return f"TP{p.tp}{dp}, EP{p.ep}, {p.nodes} node{'s' if p.nodes > 1 else ''}"


def _host(p) -> str:
    if not p.host_per_node:
        return "-"
    how = (
        "shared by the node's replicas" if p.host_shared else f"{p.host_per_rank / GIB:.2f} per GPU"
    )
    return f"{p.host_per_node / GIB:.1f} GiB per node ({how})"


def _host_short(p) -> str:
    if not p.host_per_node:
        return "-"
    return f"{p.host_per_node / GIB:.1f} GiB" + (" shared" if p.host_shared else "")


def _slots(p) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.slots_per_rank.items())


def _print_plan(p, contexts=CONTEXTS) -> None:
    from rich.table import Table

    t = Table(title=f"per GPU: {p.gpu}, {_layout(p)}", show_header=False)
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
    if p.dp > 1:
        t.add_row(
            "KV cache, all replicas", f"{p.dp} x {p.kv_tokens:,} = {p.kv_tokens_total:,} tokens"
        )
    for c in contexts:
        t.add_row(f"requests at {c:,}-token context", f"{p.concurrency(c):,}")
    if p.host_per_node:
        t.add_row("pinned host memory (Engram)", _host(p))
    if p.slots_per_rank:
        t.add_row("expert slots per rank", _slots(p))
    make_console().print(t)


def _print_comparison(plans: list[tuple[str, object]], contexts=CONTEXTS) -> None:
    """Recipes x GPUs side by side: what a second node (or a bigger card) buys."""
    from rich.table import Table

    t = Table(title="per GPU and per deployment")
    t.add_column("", no_wrap=True)
    names = [n for n, _p in plans]
    common = os.path.commonprefix(names) if len(set(names)) > 1 else ""
    common = common[: common.rfind("-") + 1]  # whole words: deepseek-v41-flash-fp8-
    for name, p in plans:
        t.add_column(f"{name[len(common) :]}\n{p.gpu}", justify="right", no_wrap=True)

    def row(label, fn):
        t.add_row(label, *(fn(p) for _n, p in plans))

    row("layout", lambda p: _layout(p).replace(", ", " "))
    row("GPUs", lambda p: f"{p.tp * p.dp}")
    row("expert slots per GPU", _slots)
    row("weights per GPU", lambda p: f"{p.weights_total / GIB:.2f} GiB")
    row("KV cache per GPU", lambda p: f"{p.kv_bytes / GIB:.2f} GiB")
    row("KV tokens per replica", lambda p: f"{p.kv_tokens:,}")
    row("replicas (DP)", lambda p: f"{p.dp}")
    row("KV tokens, all replicas", lambda p: f"{p.kv_tokens_total:,}")
    for c in contexts:
        row(f"requests at {c:,} tokens", lambda p, c=c: f"{p.concurrency(c):,}")
    row("pinned host memory per node", _host_short)
    row("fits", lambda p: "yes" if p.fits else "NO")
    console = make_console()
    if not sys.stdout.isatty():  # a piped comparison gets the width its columns need
        console.width = max(console.width, 32 + 24 * len(plans))
    console.print(t)
    for name, p in plans:
        if not p.fits:
            click.echo(f"{name} on {p.gpu}: does not fit: {p.why}")


@click.command("plan")
@click.argument("files", nargs=-1, required=True)
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Checkpoint dir.")
@click.option(
    "--gpu", "gpus", multiple=True, default=("h20-96g",), show_default=True,
    metavar="h20-96g|h20-141g|h200|h100|GIB",
    help="GPU memory per device, by name or in GiB; repeat to compare cards.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the plan(s) as JSON on stdout.")
def plan_cmd(files, model, gpus, as_json) -> None:
    """Memory per GPU for a recipe and a checkpoint, from its headers: weights by TP/EP
    (EPLB replicas included), runtime overheads (defaults from the seed's H20 profile), KV
    cache in GiB and tokens (per data-parallel replica and in all), concurrent requests per
    context, pinned host memory per node.

    \b
    Several recipes or --gpu values print them side by side, e.g. what a second node buys:
      vllm-h20 plan deepseek-v41-flash-fp8-tp8ep8 deepseek-v41-flash-fp8-2node-tp8dp2ep16 \\
          --model /models/V4.1-Flash-FP8 --gpu h20-96g --gpu h20-141g

    Exit 0 when every plan fits, 1 when one does not (the numbers say by how much)."""
    plans = []
    for f in files:
        r, res = _checked(f)
        for g in gpus:
            plans.append((r.path.stem, _plan(r, res, model, g)))
    if as_json:
        docs = [p.to_json() | {"recipe": name} for name, p in plans]
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    elif len(plans) == 1:
        p = plans[0][1]
        _print_plan(p)
        click.echo("fits" if p.fits else f"does not fit: {p.why}")
    else:
        _print_comparison(plans)
    sys.exit(0 if all(p.fits for _n, p in plans) else EXIT_CHECK_FAILED)


def _last_flag(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv (vLLM: the last one wins)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


DP_RPC_PORT = 29550  # vLLM 0.33's ParallelConfig.data_parallel_rpc_port default


def node_commands(base: list[str], parsed: dict, address: str | None, port: int,
                  gpus_per_node: int) -> list[list[str]]:  # fmt: skip
    """Each node's `vllm serve` command for a recipe: one for a one-node recipe; for more, the
    head's (API server, data-parallel ranks 0..L-1) and a headless one per other node, as vLLM's
    multi-node data parallelism wants them (vLLM 0.33: --data-parallel-size-local,
    --data-parallel-start-rank, --data-parallel-address, --data-parallel-rpc-port, --headless).
    base: `vllm serve MODEL --config FILE [EXTRA...]`."""
    from .plan import nodes_for, parallelism

    tp, dp, _ep, _r = parallelism(parsed)
    nodes = nodes_for(tp, dp, gpus_per_node)
    if nodes == 1:
        return [base]
    if dp % nodes:
        raise RecipeError(
            f"data-parallel-size {dp} x tensor-parallel-size {tp} fills {nodes} nodes of "
            f"{gpus_per_node} GPUs, but {dp} replicas do not split evenly over {nodes} nodes"
        )
    if not address:
        raise RecipeError(
            f"this recipe spans {nodes} nodes: pass --data-parallel-address HOST, the head "
            "node's address as every node reaches it"
        )
    local = dp // nodes
    out = []
    for k in range(nodes):
        node = ["--data-parallel-size-local", str(local), "--data-parallel-address", address,
                "--data-parallel-rpc-port", str(port)]  # fmt: skip
        if k:
            node = ["--headless", "--data-parallel-start-rank", str(k * local), *node]
        out.append([*base[:5], *node, *base[5:]])
    return out


# SMs per GPU name of --gpu: the fix's kernel choice depends on it (on H20's 78 SMs up to three
# swap-A/B passes per expert).
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
@click.option("--node-rank", type=click.IntRange(min=0), default=None,
              help="This node's index in a multi-node recipe (0: the head, with the API "
              "server; the others headless).")  # fmt: skip
@click.option(
    "--data-parallel-address",
    "address",
    metavar="HOST",
    default=None,
    help="Multi-node: the head node's address, as every node reaches it.",
)
@click.option(
    "--data-parallel-rpc-port",
    "rpc_port",
    type=click.IntRange(1, 65535),
    default=DP_RPC_PORT,
    show_default=True,
    help="Multi-node: the head's data-parallel RPC port (the same on every node).",
)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=GPUS_PER_NODE,
              show_default=True, help="GPUs per node, to lay a multi-node recipe out.")  # fmt: skip
@click.argument("extra", nargs=-1, type=click.UNPROCESSED)
def serve(file, model, gpu, dry_run, force, precompile, node_rank, address, rpc_port,
          gpus_per_node, extra) -> None:  # fmt: skip
    """Check the recipe, plan memory, then exec `vllm serve MODEL --config FILE [EXTRA...]`
    with the vllm-h20 plugin active (it is a vLLM general plugin: installed = active).

    A recipe with more GPUs than one node (TP x DP over --gpus-per-node) runs as vLLM's
    multi-node data parallelism: the same command on every node with its --node-rank; node 0
    serves the API, the others run headless. --dry-run without --node-rank prints every
    node's command.

    \b
      vllm-h20 serve deepseek-v41-flash-fp8-tp8ep8 --model /models/V4.1-Flash-FP8
      vllm-h20 serve recipes/my.yaml --model /m -- --port 8001
      vllm-h20 serve deepseek-v41-flash-fp8-2node-tp8dp2ep16 --model /m \\
          --data-parallel-address 10.0.0.1 --node-rank 1
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
    vllm = shutil.which("vllm")
    base = [vllm or "vllm", "serve", str(model), "--config", str(r.path), *extra]
    try:
        commands = node_commands(base, res.parsed, address, rpc_port, gpus_per_node)
    except RecipeError as e:
        _fail(str(e))
    if node_rank is not None and node_rank >= len(commands):
        _fail(f"--node-rank {node_rank}: this recipe runs on {len(commands)} node"
              f"{'s' if len(commands) > 1 else ''} (ranks 0..{len(commands) - 1})")  # fmt: skip
    if node_rank is None and len(commands) > 1 and not dry_run:
        _fail(f"this recipe spans {len(commands)} nodes: pass --node-rank N on each "
              "(0 = the head), or --dry-run to see every node's command")  # fmt: skip
    load_format = _last_flag(list(extra), "--load-format") or r.flags.get("load-format")
    p = None
    if load_format == "dummy":
        if not (model / "config.json").is_file():
            _fail(f"{model}: no config.json; with load-format dummy --model is a directory "
                  "holding the model's config.json and tokenizer")  # fmt: skip
        # Random weights: no checkpoint to read sizes from; vLLM measures memory at start.
        click.echo("plan: skipped: load-format dummy (random weights, no checkpoint to size)")
    else:
        p = _plan(r, res, model, gpu, unknown_ok=True, gpus_per_node=gpus_per_node)
    if p is not None:
        _print_plan(p)
        if not p.fits and not force:
            _fail(f"will not fit: {p.why} (see the plan above; --force starts anyway)",
                  EXIT_CHECK_FAILED)  # fmt: skip
    if precompile:
        _precompile_fix(r, res.parsed, model, gpu, list(extra), dry_run)
    if len(commands) > 1 and node_rank is None:
        for k, cmd in enumerate(commands):
            role = "head, API server" if k == 0 else "headless"
            click.echo(f"# node {k} ({role})\n$ " + shlex.join(cmd))
        return
    argv = commands[node_rank or 0]
    click.echo("$ " + shlex.join(argv))
    if dry_run:
        return
    if vllm is None:
        _fail("the `vllm` command is not on PATH (install vLLM: README, set-up command 2)")
    sys.stdout.flush()
    os.execvp(vllm, argv)
