"""`vllm-h20 convert|verify|synth|demo`: the MXFP4 release to a standalone FP8 checkpoint, the
check that it decodes to the same values, and the small generated checkpoints that try both."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click

from ..exits import EXIT_CHECK_FAILED
from ..exits import fail as _fail


def user_errors():
    """Exceptions that mean bad input, printed as one line instead of a traceback."""
    from .rules import RulesError
    from .safetensors_io import CheckpointError
    from .shard import ConvertError

    return (RulesError, CheckpointError, ConvertError)


COMMANDS = ("convert", "verify", "synth", "demo")


_rules_opt = click.option(
    "--rules",
    default=None,
    metavar="FILE|NAME",
    help="Conversion rules (YAML). Default: the shipped deepseek_v41_flash rules.",
)


# convert and verify both work one output shard per process.
_workers_opt = click.option(
    "-j",
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (one output shard each). Default: CPU count, at most 8.",
)


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@_rules_opt
@_workers_opt
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion into DST.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier conversion's output in DST.")
@click.option(
    "--keep-unmatched",
    is_flag=True,
    help="Copy tensors that no rule covers as they are instead of stopping.",
)
@click.option(
    "--band-mib",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Input MiB processed at once per worker: bounds memory (~12x this per worker).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or table.")
def convert(src, dst, rules, workers, resume, overwrite, keep_unmatched, band_mib, as_json, quiet):
    """Convert the MXFP4 release in SRC into a standalone FP8-128 checkpoint in DST.

    Routed experts (main model and DSpark draft) become E4M3 with float32 128x128
    power-of-two block scales, bit-exact wherever E4M3 can hold the value; other FP8
    linears are re-blocked from 32x32 (V4.1) or 128x128 (V4) E8M0 scales; everything else
    is copied byte for byte. config.json and the index are rewritten, other files copied.
    SRC is never modified. Writes DST/conversion_report.json.
    """
    import json

    from . import report
    from . import rules as rules_mod
    from .runner import Options
    from .runner import convert as run

    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other")
    rs = rules_mod.load(rules)
    opts = Options(
        workers=workers or Options().workers,
        resume=resume,
        overwrite=overwrite,
        keep_unmatched=keep_unmatched,
        band_mib=band_mib,
        progress=not quiet,
    )
    doc = run(src, dst, rs, opts)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    elif not quiet:
        report.render(doc)
        click.echo(f"wrote {dst} (report: {dst / report.REPORT})")


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@_rules_opt
@click.option(
    "--sample",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Check N converted tensors per group (evenly spread) instead of all. "
    "Copied tensors and files are always checked in full.",
)
@_workers_opt
def verify(src, dst, rules, sample, workers):
    """Re-read SRC and DST and check every converted tensor and every copied byte.

    Each output element must be the nearest E4M3 value of the source value under a
    power-of-two block scale that cannot overflow; copied tensors and files must be
    byte-identical; config.json and the index must be what the rules say. Exit 1 on any
    mismatch.
    """
    from . import rules as rules_mod
    from .runner import Options

    res = _verify(src, dst, rules_mod.load(rules), sample, workers=workers or Options().workers)
    sys.exit(0 if res.ok else EXIT_CHECK_FAILED)


def _verify(src, dst, rs, sample, console=None, workers: int = 1):
    from rich.table import Table

    from ..console import byte_progress, make_console
    from .report import human_bytes
    from .verify import verify as run

    console = console or make_console()
    t0 = time.perf_counter()
    bar = byte_progress(make_console(stderr=True))
    with bar:
        task = bar.add_task("verifying", total=None)
        res = run(
            src,
            dst,
            rs,
            sample,
            lambda done, total: bar.update(task, completed=done, total=total),
            workers=workers,
        )
    t = Table(title="Verification", title_justify="left")
    for c in ("group", "checked", "bit-exact", "max |err|", "rel L2"):
        t.add_column(c, justify="left" if c == "group" else "right")
    for g, s in sorted(res.groups.items()):
        t.add_row(
            g,
            f"{s.tensors:,} of {res.planned.get(g, 0):,}",
            f"{100 * s.exact_fraction:.6f} %",
            f"{s.max_abs_err:.3g}",
            f"{s.rel_l2:.3g}",
        )
    console.print(t)
    console.print(
        f"copied tensors byte-identical: {res.copied_tensors:,} "
        f"({human_bytes(res.copied_bytes)}); other files: {res.files}; "
        f"{time.perf_counter() - t0:.1f} s"
    )
    for f in res.failures[:20]:
        console.print(f"[red]FAIL[/] {f}")
    console.print(
        "[green]verify: OK[/]" if res.ok else f"[red]verify: {len(res.failures)} failure(s)[/]"
    )
    return res


_spread_opt = click.option(
    "--spread",
    type=click.IntRange(min=0, max=100),
    default=6,
    show_default=True,
    help="E8M0 exponent spread inside blocks of the generated checkpoint; above 14 some "
    "expert blocks cannot be held exactly in E4M3 and the report counts them.",
)


@click.command()
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--preset",
    type=click.Choice(["tiny", "bench", "flash", "v4-h200"]),
    default="tiny",
    show_default=True,
    help="Shapes: tiny (tests), bench (~2.3 GiB, real matrix "
    "shapes), flash (the full published V4.1-Flash shapes; use with --sparse), v4-h200 "
    "(with --layout v4: V4.1-Flash's experts, V4's attention, 3 layers, 21.6 GB; the "
    "one-H200 journey).",
)
@click.option("--layers", type=int, default=None, help="Override the number of layers.")
@click.option("--experts", type=int, default=None, help="Override routed experts per layer.")
@click.option(
    "--layout",
    type=click.Choice(["v41", "v4"]),
    default="v41",
    show_default=True,
    help="v41: other linears with E8M0 32x32 scales; v4: 128x128.",
)
@click.option("--shards", type=click.IntRange(min=1), default=4, show_default=True)
@_spread_opt
@click.option(
    "--router",
    type=click.Choice(["trained", "random"]),
    default="trained",
    show_default=True,
    help="trained: each layer's gate bias fitted so expert loads follow DeepSeek's published "
    "EPLB example (a few hot, a few cold experts); random: near-uniform routing.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--sparse", is_flag=True, help="Write headers only (sparse files of full size).")
@click.option(
    "--converted",
    is_flag=True,
    help="Write what `vllm-h20 convert` would make of it (FP8 layout), headers only: a "
    "full-size served checkpoint for `plan` and `serve --dry-run`.",
)
def synth(dst, preset, layers, experts, layout, shards, spread, router, seed, sparse, converted):
    """Write a synthetic checkpoint in the DeepSeek-V4.1-Flash release layout to DST."""
    from .synth import generate, generate_converted, scaled

    if dst.exists() and any(dst.iterdir()):
        _fail(f"{dst}: not empty; choose a new directory")
    shape = scaled(preset, layers=layers, experts=experts)
    if converted:
        info = generate_converted(dst, shape, shards=shards)
        click.echo(f"wrote {info['tensors']:,} tensors (FP8 layout, headers only), "
                   f"{info['bytes'] / 2**30:.2f} GiB, to {dst}")  # fmt: skip
        return
    info = generate(
        dst,
        shape,
        layout=layout,
        shards=shards,
        spread=spread,
        seed=seed,
        sparse=sparse,
        router=router,
    )
    click.echo(
        f"wrote {info['tensors']:,} tensors in {info['shards']} shard(s), "
        f"{info['bytes'] / 2**30:.3f} GiB, to {dst}"
    )


@click.command()
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where to put the generated and converted checkpoints (default: a "
    "temporary directory, removed afterwards).",
)
@_spread_opt
def demo(workdir, spread):
    """Generate a small V4.1-layout checkpoint, convert it, verify it, print both reports."""
    from . import report
    from . import rules as rules_mod
    from .runner import Options
    from .runner import convert as run
    from .synth import PRESETS, generate

    def go(root: Path) -> int:
        src, dst = root / "src", root / "fp8"
        info = generate(src, PRESETS["tiny"], shards=3, spread=spread)
        click.echo(
            f"generated {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) in {src}"
        )
        rs = rules_mod.load(None)
        doc = run(src, dst, rs, Options(workers=2, overwrite=True))
        report.render(doc)
        res = _verify(src, dst, rs, None)
        return 0 if res.ok else EXIT_CHECK_FAILED

    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
        sys.exit(go(workdir))
    with tempfile.TemporaryDirectory(prefix="vllm-h20-demo-") as d:
        code = go(Path(d))
    sys.exit(code)
