"""`vllm-h20 kernels ...` and `vllm-h20 patches ...`: the patched FlashInfer module and the
upstream patches it is built from."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path

import click

from .. import settings
from ..console import make_console, step_progress
from ..exits import EXIT_CHECK_FAILED
from ..exits import fail as _fail
from . import compile_check, dispatch, export_pr, flashinfer_src, overlay, paths
from . import plan as build_plan
from .patchfile import PatchError


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _built_modules(src: flashinfer_src.FlashInferSource, key: str) -> list[Path]:
    """Patched full modules already in FlashInfer's JIT cache (any arch, generic or H20)."""
    return sorted(
        paths.flashinfer_jit_dir(src.version).glob(
            f"*/cached_ops/*_vllm_h20_{key[:8]}/*_vllm_h20_{key[:8]}.so"
        )
    )


def _built_reduced(src: flashinfer_src.FlashInferSource) -> list[Path]:
    """Reduced block-scale modules (fix and stock) already in FlashInfer's JIT cache."""
    return sorted(
        paths.flashinfer_jit_dir(src.version).glob(
            "*/cached_ops/*_vllm_h20_bs_*/*_vllm_h20_bs_*.so"
        )
    )


def _routes(decision: dispatch.Decision) -> list[tuple[str, str]]:
    """(call, what vLLM runs it on) for the SM90 fused MoE under a decision."""
    flashinfer = "FlashInfer's own SM90 fused-MoE module (built by FlashInfer on first use)"
    if decision.route is not None:
        which = (
            "the reduced fix module (patched sources, per-expert kernel choice)"
            if decision.route == "fix"
            else "the reduced stock module (unpatched sources: the A/B baseline)"
        )
        return [
            ("cutlass_fused_moe(use_deepseek_fp8_block_scale=True)", which),
            ("every other cutlass_fused_moe call", flashinfer),
        ]
    if decision.overlay:
        return [("every cutlass_fused_moe call", "FlashInfer's whole module, patched")]
    return [("every cutlass_fused_moe call", flashinfer)]


# --------------------------------------------------------------------------- kernels


@click.group()
def kernels() -> None:
    """The FlashInfer SM90 fused-MoE modules the vLLM plugin makes vLLM use.

    By default vLLM runs FP8 block-scale MoE calls on a reduced module (that path only, built
    in minutes) made from the patched sources; VLLM_H20_MOE_DISPATCH=stock makes it the same
    reduced module from FlashInfer's own sources (the A/B baseline); VLLM_H20_MOE_MODULE=full
    patches FlashInfer's whole module instead (~40 min on 16 cores).

    \b
      vllm-h20 kernels status                   which module vLLM loads for which call
      vllm-h20 kernels build                    prebuild the fix module
      vllm-h20 kernels build --dispatch both    ... and the stock one, for A/B runs
    """


@kernels.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON on stdout.")
def status(as_json: bool) -> None:
    """Versions, settings, which module vLLM loads for which MoE call, and what is built.

    Exit code 0 when vLLM would run the per-expert dispatch (patched or already fixed), 1 when
    it would run the stock kernel choice."""
    env = settings.current()
    info: dict = {
        "vllm_h20": _version("vllm-h20"),
        "vllm": _version("vllm"),
        "torch": _version("torch"),
        "flashinfer": None,
        "dispatch_env": env[dispatch.ENV],
        "module_env": env[dispatch.MODULE_ENV],
        "strict_env": env[dispatch.STRICT_ENV],
    }
    try:
        decision = dispatch.decide()
    except dispatch.DispatchConfigError as e:
        _fail(str(e))
    info["active"] = decision.message
    info["routes"] = [f"{call} -> {where}" for call, where in _routes(decision)]
    if decision.src is not None:
        src = decision.src
        info.update(flashinfer=src.version, flashinfer_dir=str(src.package_dir))
        if decision.assessment is not None:
            info.update(
                fix_state=decision.assessment.state.value,
                fix_detail=decision.assessment.detail,
                patches=[
                    f.relative_to(overlay.patches_dir()).as_posix()
                    for f in overlay.series_files(src.version)
                ],
            )
        built = _built_reduced(src)
        if decision.patches:
            built += _built_modules(src, overlay.overlay_for(src, decision.patches).key)
        info["built"] = [str(b) for b in built]
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        from rich.table import Table

        t = Table(show_header=False, box=None)
        for k, v in info.items():
            if isinstance(v, list):
                v = "\n".join(v) if v else "none"
            t.add_row(k, str(v))
        make_console().print(t)
        if (decision.route or decision.overlay) and not info.get("built"):
            click.echo(
                "Nothing is built yet: vLLM builds the module on its first MoE call, "
                "or run `vllm-h20 kernels build` now."
            )
    sys.exit(0 if decision.per_expert else EXIT_CHECK_FAILED)


@kernels.command()
@click.option(
    "-j", "--jobs", type=click.IntRange(min=1), default=None,
    help="Parallel compile jobs. Default: $MAX_JOBS, else the CPU count. Each needs ~4 GB RAM.",
)  # fmt: skip
@click.option(
    "--dispatch",
    "dispatch_",
    type=click.Choice(["per_expert", "stock", "both"]),
    default="per_expert",
    show_default=True,
    help="Which reduced module: the fix (per_expert), the unpatched A/B baseline (stock), or both.",
)
@click.option(
    "--module",
    type=click.Choice(["reduced", "full"]),
    default=None,
    help="reduced: the FP8 block-scale path only (default, minutes); full: FlashInfer's whole "
    "SM90 module from the patched sources (~250 objects). Default: $VLLM_H20_MOE_MODULE.",
)
@click.option(
    "--variant",
    type=click.Choice(["auto", "h20", "generic"]),
    default="auto",
    show_default=True,
    help="auto: as FlashInfer picks for the visible GPU; h20: FlashInfer's 78-SM variant "
    "(build an H20 image on a machine without one); generic: other Hopper GPUs.",
)
@click.option(
    "--arch",
    default=None,
    metavar="LIST",
    help="FLASHINFER_CUDA_ARCH_LIST for the build. Default: the GPU's, or 9.0a without a GPU.",
)
@click.option("--clean", is_flag=True, help="Delete the module's build directory first.")
@click.option("--log", type=click.Path(path_type=Path), default=None, help="Write ninja's log.")
@click.option(
    "--dry-run", is_flag=True, help="Prepare the sources and ninja file; compile nothing."
)
@click.option("--json", "as_json", is_flag=True, help="Print what was built as JSON on stdout.")
def build(
    jobs: int | None,
    dispatch_: str,
    module: str | None,
    variant: str,
    arch: str | None,
    clean: bool,
    log: Path | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Build the module vLLM will load into FlashInfer's JIT cache (no GPU needed).

    The reduced module is FlashInfer's own build (same flags and ninja file) of the sources the
    FP8 block-scale path compiles, FlashInfer's SM90 FP8 grouped GEMMs (FAST_BUILD), and stubs
    for the rest; the link is checked for undefined symbols. vLLM then loads it instead of
    compiling on its first MoE call."""
    from . import build as b

    if arch is None and not os.environ.get("FLASHINFER_CUDA_ARCH_LIST") and not _has_gpu():
        arch = "9.0a"
    env = b.jit_env(arch=arch)
    os.environ.update(env)
    jobs = jobs or int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count() or 1
    try:
        module = module or dispatch.settings().module
    except dispatch.DispatchConfigError as e:
        _fail(str(e))
    console = make_console(stderr=True)
    if module == "full":
        if dispatch_ != "per_expert":
            _fail("--module full builds only the patched module: FlashInfer builds its own")
        _build_full(b, jobs, variant, log, dry_run, console, env, clean)
        return
    modes = ["per_expert", "stock"] if dispatch_ == "both" else [dispatch_]
    results = []
    for mode in modes:
        results.append(_build_reduced(b, mode, jobs, variant, log, dry_run, clean, console))
    if as_json:
        click.echo(json.dumps(results, indent=2))


def _build_reduced(b, mode, jobs, variant, log, dry_run, clean, console) -> dict:
    from . import reduced

    try:
        build_plan.select_variant(variant)
        decision = dispatch.decide(env={dispatch.ENV: mode, dispatch.MODULE_ENV: "reduced"})
    except (b.BuildError, dispatch.DispatchConfigError) as e:
        _fail(str(e))
    if decision.route is None:
        _fail(decision.message.split(": ", 1)[-1])
    from flashinfer.jit import fused_moe as jit_fused_moe

    stock_gen = jit_fused_moe.gen_cutlass_fused_moe_sm90_module
    t0 = time.monotonic()
    try:
        spec = dispatch.reduced_spec(decision, stock_gen, build=False)
    except (b.BuildError, reduced.ReduceError, PatchError) as e:
        _fail(str(e), EXIT_CHECK_FAILED)
    if clean and Path(spec.build_dir).exists():
        shutil.rmtree(spec.build_dir)
    with step_progress(console) as bar:
        task = bar.add_task(f"{decision.route} module", total=None, current="")

        def on_status(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, current=Path(what.split()[-1]).name)

        def run(targets: list[str]) -> None:
            b.run_ninja(b.NinjaFile.of(spec), targets, jobs, os.environ, on_status, log)

        try:
            if dry_run:
                spec.write_ninja()
            else:
                reduced.prepare(spec, run)
                run([])  # the stubs and the link
        except (b.BuildError, reduced.ReduceError) as e:
            _fail(str(e), EXIT_CHECK_FAILED)
    result = {
        "dispatch": mode,
        "module": spec.name,
        "library": str(spec.jit_library_path),
        "objects": len(spec.sources),
        "seconds": round(time.monotonic() - t0, 1),
        "plan": dataclasses.asdict(build_plan.reduced_plan(spec, decision)),
    }
    if dry_run:
        console.print(f"would build [bold]{spec.name}[/] ({len(spec.sources)} objects) in "
                      f"{spec.build_dir}")  # fmt: skip
        return result
    problems = reduced.check_link(spec)
    result["link_problems"] = problems
    if problems:
        _fail("; ".join(problems), EXIT_CHECK_FAILED)
    console.print(
        f"built {spec.jit_library_path} ({len(spec.sources)} objects, link checked) in "
        f"{result['seconds']:.0f} s"
    )
    return result


def _build_full(b, jobs, variant, log, dry_run, console, env, clean) -> None:
    try:
        plan, ov = build_plan.full_plan(variant)
    except (b.BuildError, PatchError) as e:
        _fail(str(e))
    if clean and Path(plan.library).exists():
        Path(plan.library).unlink()
    console.print(
        f"{'would build' if dry_run else 'building'} [bold]{plan.module}[/] "
        f"({len(plan.objects)} objects, {len(plan.touched)} of them from patched sources, "
        f"-j {jobs})\n  patched sources: {ov.root}\n  build dir:       {plan.build_dir}\n"
        f"  module:          {plan.library}"
        + (" (already built)" if Path(plan.library).exists() else "")
    )
    if dry_run:
        return
    t0 = time.monotonic()
    from filelock import FileLock

    with step_progress(console) as bar, FileLock(str(Path(plan.build_dir) / ".vllm_h20.lock")):
        task = bar.add_task("compile", total=None, current="")

        def on_status(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, current=Path(what.split()[-1]).name)

        try:
            b.run_ninja(plan, None, jobs, env, on_status, log)
        except b.BuildError as e:
            _fail(str(e), EXIT_CHECK_FAILED)
    console.print(f"built {plan.library} in {time.monotonic() - t0:.0f} s")


@kernels.command()
@click.argument("model", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--ep-size", type=click.IntRange(min=1), default=1, show_default=True,
    help="Expert-parallel ranks the experts are spread over (the recipes: 8).",
)  # fmt: skip
@click.option(
    "--num-redundant-experts", type=click.IntRange(min=0), default=0, show_default=True,
    help="EPLB's extra expert slots (eplb-config.num_redundant_experts; the recipes: 16): they "
    "set the experts per rank, which the kernels are compiled for.",
)  # fmt: skip
@click.option(
    "--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
    help="Data-parallel replicas whose steps one MoE layer sees at once (with expert "
    "parallelism every rank gathers all replicas' tokens).",
)  # fmt: skip
@click.option(
    "--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
    help="The most tokens one replica's step holds: vLLM's --max-num-batched-tokens (8192 is "
    "its default for `vllm serve` on these GPUs); one MoE call sees this times "
    "--data-parallel-size.",
)  # fmt: skip
@click.option(
    "--num-sms", type=click.IntRange(min=1), default=None,
    help="The GPU's SM count (78: H20, 132: H100/H200). Default: the visible GPU's.",
)  # fmt: skip
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel nvcc jobs. Default: the CPU count.")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="List the kernels and what is cached; compile none.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def precompile(model: Path, ep_size: int, num_redundant_experts: int, data_parallel_size: int,
               max_num_batched_tokens: int, num_sms: int | None, jobs: int | None,
               dry_run: bool, as_json: bool) -> None:  # fmt: skip
    """Compile every DeepGEMM kernel the fix can launch for MODEL, before serving it.

    The per-expert dispatch picks its kernels from each step's token count, and DeepGEMM
    compiles a kernel the first time it is launched (seconds each, with the engine waiting).
    This compiles the whole set for MODEL's MoE shapes (config.json), --ep-size,
    --num-sms and every step size up to --max-num-batched-tokens, in parallel, into the cache
    DeepGEMM reads ($TRTLLM_DG_CACHE_DIR, else ~/.tensorrt_llm). Kernels this compiled from the
    same sources before are kept; a cut run loses nothing. A kernel there built from other
    sources (another patch series, an earlier vllm-h20, FlashInfer's own headers, DeepGEMM's
    own run-time build) is compiled again: DeepGEMM names a kernel by its template arguments
    only, and would load that one in the fix's place. Runs on the GPU machine or, with
    --num-sms, any machine with nvcc whose cache directory the servers will use. Exit 1 if a
    kernel failed."""
    from . import precompile as pc

    try:
        shape = pc.shape_from_config(model / "config.json", ep_size, num_redundant_experts)
        if num_sms is None:
            if not _has_gpu():
                raise pc.PrecompileError(
                    "no GPU visible: pass --num-sms (78 for H20, 132 for H100/H200)"
                )
            import torch

            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        rows = max_num_batched_tokens * (data_parallel_size if ep_size > 1 else 1)
        result = pc.run(shape, num_sms, rows, jobs, make_console(stderr=True), dry_run=dry_run)
    except (pc.PrecompileError, dispatch.DispatchConfigError, PatchError, OSError) as e:
        _fail(str(e))
    result = {"model": str(model)} | result
    if as_json:
        click.echo(json.dumps(result, indent=2))
    if not dry_run and result["failed"]:
        sys.exit(EXIT_CHECK_FAILED)


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - any failure means "no usable GPU"
        return False


# --------------------------------------------------------------------------- patches


@click.group()
def patches() -> None:
    """The upstream FlashInfer patches (patches/flashinfer/*.patch): check and export.

    \b
      vllm-h20 patches check                      apply-check on the installed FlashInfer
      vllm-h20 patches check --flashinfer W.whl   ... on a wheel or unpacked tree
      vllm-h20 patches check --compile            also compile every touched source (nvcc)
      vllm-h20 patches export DIR                 patch files + evidence for an upstream PR
    """


def _source_from(
    path: Path | None, workdir: Path
) -> tuple[flashinfer_src.FlashInferSource, Path | None]:
    """(sources, the import root to put on PYTHONPATH or None for the installed one)."""
    from . import build as b

    if path is None:
        return flashinfer_src.installed(), None
    if not path.exists():
        _fail(f"{path}: no such file or directory")
    if path.is_file():
        root = b.unpack_wheel(path, workdir / "wheels")
        return flashinfer_src.from_package_dir(root), root
    src = flashinfer_src.from_package_dir(path)
    return src, src.package_dir.parent


@patches.command()
@click.option(
    "--flashinfer",
    "fi_path",
    type=click.Path(path_type=Path),
    default=None,
    metavar="WHEEL|DIR",
    help="Check this FlashInfer (a .whl, an unpacked wheel, or a package dir) instead of the "
    "installed one.",
)
@click.option(
    "--compile",
    "do_compile",
    is_flag=True,
    help="Build and link the reduced fix module (the FP8 block-scale path, with FlashInfer's own "
    "JIT flags; nvcc, sm_90a, no GPU needed; ~20 core-minutes), check its link for undefined "
    "symbols and that every source including a patched file compiled the patched copy.",
)
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Compile jobs.")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where unpacked wheels, the overlay and objects go. Default: a cache under "
    "$VLLM_H20_CACHE_DIR (kept, so a rerun is quick).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def check(fi_path, do_compile, jobs, workdir, as_json) -> None:
    """Check that the patches apply (exit 0), or say why not (exit 1).

    "has-fix" (the sources already contain the patches) also exits 0."""
    from . import build as b

    workdir = workdir or paths.check_dir()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        src, import_root = _source_from(fi_path, workdir)
        ps = overlay.shipped_patches(src.version)
    except (PatchError, flashinfer_src.FlashInferNotFound, b.BuildError) as e:
        _fail(str(e))
    a = overlay.assess(src, ps)
    series = overlay.series_name(src.version)
    result: dict = {
        "flashinfer": src.version,
        "flashinfer_dir": str(src.package_dir),
        "supported": dispatch.supported(src.version),
        "series": series,
        "patches": [
            f.relative_to(overlay.patches_dir()).as_posix()
            for f in overlay.series_files(src.version)
        ],
        "state": a.state.value,
        "detail": a.detail,
    }
    ok = a.state in (overlay.FixState.NEEDS_PATCH, overlay.FixState.HAS_FIX)
    if do_compile and a.state is overlay.FixState.NEEDS_PATCH:
        result["compile"] = compile_check.compile_touched(
            src, ps, import_root, workdir, jobs, as_json
        )
        ok = ok and result["compile"]["ok"]
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        mark = "ok" if ok else "FAIL"
        click.echo(f"{mark}: FlashInfer {src.version}: {a.state.value}: {a.detail} ({series})")
        if not result["supported"]:
            click.echo(
                f"  note: vllm-h20 supports FlashInfer {dispatch.supported_text()}; the plugin "
                f"leaves {src.version} stock"
            )
        comp = result.get("compile", {})
        for obj in comp.get("objects", []):
            took = f"{obj['seconds']:.0f} s" if obj["seconds"] is not None else "time unknown"
            state = "compiled" if obj["built"] else "NOT BUILT"
            click.echo(f"  {state} {obj['source']} ({took})")
        if comp.get("ok"):
            click.echo(f"  linked {comp['library']}: no undefined symbols beyond its libraries")
        for p in result.get("compile", {}).get("problems", []):
            click.echo(f"  FAIL {p}")
    sys.exit(0 if ok else EXIT_CHECK_FAILED)


@patches.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--results",
    type=click.Path(path_type=Path),
    default=Path("benchmarks/results"),
    show_default=True,
    help="Where the measured evidence (moe_dispatch_*, fused_moe_*: md/json/png) is.",
)
def export(out: Path, results: Path) -> None:
    """Write the patches and the evidence for an upstream pull request into OUT.

    OUT gets the .patch files (for `git am`), PR.md (title, description from the commit
    message, with the Evidence section filled from the results), and the evidence files."""
    try:
        ps = overlay.shipped_patches()
    except PatchError as e:
        _fail(str(e))
    if out.exists() and any(out.iterdir()):
        _fail(f"{out} is not empty; choose a new directory")
    evidence = export_pr.write(out, ps, results)
    click.echo(f"wrote {out}: {len(ps)} patch(es), {len(evidence)} evidence file(s)")
    if not evidence:
        click.echo(f"note: no benchmark results in {results}; PR.md says so", err=True)
