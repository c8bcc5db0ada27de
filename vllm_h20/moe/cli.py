"""`vllm-h20 kernels ...` and `vllm-h20 patches ...`: the patched FlashInfer module and the
upstream patches it is built from."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from ..console import make_console, step_progress
from ..exits import EXIT_CHECK_FAILED
from ..exits import fail as _fail
from . import dispatch, flashinfer_src, overlay
from .patchfile import PatchError


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _built_modules(src: flashinfer_src.FlashInferSource, key: str) -> list[Path]:
    """Patched modules already in FlashInfer's JIT cache (any arch, generic or H20 variant)."""
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home()))
    root = base / ".cache" / "flashinfer" / src.version
    return sorted(root.glob(f"*/cached_ops/*_vllm_h20_{key[:8]}/*_vllm_h20_{key[:8]}.so"))


# --------------------------------------------------------------------------- kernels


@click.group()
def kernels() -> None:
    """The patched FlashInfer SM90 fused-MoE module that the vLLM plugin makes vLLM use.

    \b
      vllm-h20 kernels status          what is installed, fixed, built
      vllm-h20 kernels build -j 16     prebuild it (else vLLM builds it on first use)
    """


@kernels.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON on stdout.")
def status(as_json: bool) -> None:
    """Versions, whether FlashInfer needs the fix, and the build cache state.

    Exit code 0 when vLLM would run the per-expert dispatch (patched or already fixed), 1 when
    it would run the stock kernel choice."""
    info: dict = {
        "vllm_h20": _version("vllm-h20"),
        "vllm": _version("vllm"),
        "torch": _version("torch"),
        "flashinfer": None,
        "dispatch_env": os.environ.get(dispatch.ENV, "per_expert (default)"),
    }
    try:
        decision = dispatch.decide()
    except dispatch.DispatchConfigError as e:
        _fail(str(e))
    info["active"] = decision.message
    if decision.src is not None:
        src = decision.src
        patches = overlay.shipped_patches()
        ov = overlay.overlay_for(src, patches)
        built = _built_modules(src, ov.key)
        info.update(
            flashinfer=src.version,
            flashinfer_dir=str(src.package_dir),
            fix_state=decision.assessment.state.value if decision.assessment else None,
            fix_detail=decision.assessment.detail if decision.assessment else None,
            patches=[p.name for p in patches],
            overlay=str(ov.root),
            overlay_ready=ov.complete,
            module_prefix=f"fused_moe_90*_vllm_h20_{ov.key[:8]}",
            built=[str(b) for b in built],
        )
    per_expert = decision.overlay or (
        decision.assessment is not None
        and decision.assessment.state in (overlay.FixState.HAS_FIX, overlay.FixState.FIXED_UPSTREAM)
    )
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
        if decision.overlay and not info.get("built"):
            click.echo(
                "The patched module is not built yet: vLLM builds it on first use (long), "
                "or run `vllm-h20 kernels build` now."
            )
    sys.exit(0 if per_expert else EXIT_CHECK_FAILED)


@kernels.command()
@click.option(
    "-j", "--jobs", type=click.IntRange(min=1), default=None,
    help="Parallel compile jobs. Default: $MAX_JOBS, else the CPU count. Each needs ~4 GB RAM.",
)  # fmt: skip
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
@click.option("--log", type=click.Path(path_type=Path), default=None, help="Write ninja's log.")
@click.option(
    "--dry-run", is_flag=True, help="Prepare the patched sources and ninja file; compile nothing."
)
def build(
    jobs: int | None, variant: str, arch: str | None, log: Path | None, dry_run: bool
) -> None:
    """Build the patched SM90 fused-MoE module into FlashInfer's JIT cache.

    The module is FlashInfer's own (same sources, flags and ninja file), compiled from the
    patched overlay under a distinct name; vLLM then loads it instead of building it on the
    first request. The full module is ~250 objects: about 40 minutes on 16 cores."""
    from . import build as b

    if arch is None and not os.environ.get("FLASHINFER_CUDA_ARCH_LIST") and not _has_gpu():
        arch = "9.0a"
    env = b.jit_env(arch=arch)
    os.environ.update(env)
    jobs = jobs or int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count() or 1
    try:
        plan, ov = b.plan(variant)
    except (b.BuildError, PatchError) as e:
        _fail(str(e))
    console = make_console(stderr=True)
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
    help="Compile every source the patches touch, with FlashInfer's own JIT flags for the SM90 "
    "fused-MoE module (nvcc, sm_90a; ~1-2 min per file per core).",
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

    workdir = workdir or overlay.cache_root() / "check"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        ps = overlay.shipped_patches()
        src, import_root = _source_from(fi_path, workdir)
    except (PatchError, flashinfer_src.FlashInferNotFound, b.BuildError) as e:
        _fail(str(e))
    a = overlay.assess(src, ps)
    result: dict = {
        "flashinfer": src.version,
        "flashinfer_dir": str(src.package_dir),
        "patches": [p.name for p in ps],
        "state": a.state.value,
        "detail": a.detail,
    }
    ok = a.state in (overlay.FixState.NEEDS_PATCH, overlay.FixState.HAS_FIX)
    if do_compile and a.state is overlay.FixState.NEEDS_PATCH:
        result["compile"] = _compile_touched(src, ps, import_root, workdir, jobs, as_json)
        ok = ok and result["compile"]["ok"]
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        mark = "ok" if ok else "FAIL"
        click.echo(f"{mark}: FlashInfer {src.version}: {a.state.value}: {a.detail}")
        for obj in result.get("compile", {}).get("objects", []):
            took = f"{obj['seconds']:.0f} s" if obj["seconds"] is not None else "time unknown"
            state = "compiled" if obj["built"] else "NOT BUILT"
            click.echo(f"  {state} {obj['source']} ({took})")
        for p in result.get("compile", {}).get("problems", []):
            click.echo(f"  FAIL {p}")
    sys.exit(0 if ok else EXIT_CHECK_FAILED)


def _compile_touched(src, ps, import_root, workdir: Path, jobs, quiet: bool) -> dict:
    from . import build as b

    ov = overlay.overlay_for(src, ps, workdir / "overlay")
    tag = f"{src.version}-{ov.key[:8]}"
    env = b.jit_env(workspace=workdir / "jit" / tag, arch="9.0a", cache=workdir / "overlay")
    try:
        plan = b.plan_in_subprocess(import_root, env)
    except b.BuildError as e:
        return {"ok": False, "problems": [str(e)], "objects": []}
    if not plan.touched:
        return {"ok": False, "problems": ["no source includes a patched file"], "objects": []}
    jobs = jobs or min(len(plan.touched), os.cpu_count() or 1)
    console = make_console(stderr=True)
    problems = []
    log = workdir / "jit" / tag / "ninja.log"
    targets = [plan.objects[s] for s in plan.touched]
    with step_progress(console, disable=quiet) as bar:
        task = bar.add_task(f"FlashInfer {src.version}", total=len(targets), current="")

        def on_status(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, current=Path(what.split()[-1]).name)

        try:
            b.run_ninja(plan, targets, jobs, env, on_status, log=log)
            bar.update(task, completed=len(targets), current="")  # also when all up to date
        except b.BuildError as e:
            problems.append(str(e))
    seconds = b.build_seconds(plan)
    objects = [
        {
            "source": _csrc_relative(source),
            "object": plan.objects[source],
            "built": Path(plan.objects[source]).is_file(),
            "seconds": seconds.get(os.path.normpath(plan.objects[source])),
        }
        for source in plan.touched
    ]
    if not problems:
        # ninja occasionally records no dependencies for an object (seen once with two nvcc
        # jobs in parallel); rebuild such an object alone so the header check has its list.
        for source in plan.touched:
            obj = plan.objects[source]
            if not b.headers_used(plan, obj):
                Path(obj).unlink(missing_ok=True)
                try:
                    b.run_ninja(plan, [obj], 1, env, log=log)
                except b.BuildError as e:
                    problems.append(str(e))
    if not problems:
        problems += b.wrong_headers(plan, ov, src.csrc_dir.resolve())
    return {"ok": not problems, "module": plan.module, "objects": objects, "problems": problems}


def _csrc_relative(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[parts.index("csrc") :]) if "csrc" in parts else path


@patches.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--results",
    type=click.Path(path_type=Path),
    default=Path("benchmarks/results"),
    show_default=True,
    help="Where the measured evidence (moe_dispatch_*.md/json/png) is.",
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
    evidence = sorted(results.glob("moe_dispatch_*")) if results.is_dir() else []
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out.parent.exists() else None))
    try:
        for p in sorted((overlay.patches_dir() / "flashinfer").glob("*.patch")):
            shutil.copyfile(p, tmp / p.name)
        (tmp / "evidence").mkdir()
        for e in evidence:
            shutil.copyfile(e, tmp / "evidence" / e.name)
        (tmp / "PR.md").write_text(_pr_text(ps, evidence), encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    click.echo(f"wrote {out}: {len(ps)} patch(es), {len(evidence)} evidence file(s)")
    if not evidence:
        click.echo(f"note: no moe_dispatch_* results in {results}; PR.md says so", err=True)


def _pr_text(ps, evidence: list[Path]) -> str:
    parts = [f"# {ps[0].subject}", ""]
    for p in ps:
        body = p.message
        marker = body.find("\nEvidence:")
        if marker >= 0:
            body = body[:marker].rstrip()
        parts += [body, ""]
    parts += ["## Evidence", ""]
    tables = [e for e in evidence if e.suffix == ".md"]
    if not tables:
        parts.append("Not measured yet: no benchmark results were found when this was exported.")
    for e in tables:
        parts += [f"### {e.stem}", "", e.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(parts).rstrip() + "\n"
