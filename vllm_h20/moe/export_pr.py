"""`patches export`: the shipped patch series and its measured evidence laid out for upstream: the
patch files for `git am`, PR.md (the pull request's description), ISSUE.md (the bug report a
maintainer reads first: symptom, the line, a reproducer, the numbers), the reproducer itself
(`reproduce_expected_m.py`, FlashInfer and torch only) and the evidence files."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .overlay import patches_dir
from .patchfile import Patch

# The shipped series' evidence: its run folders under the results folder, newest first (the
# H100 run of the shipped series on five shape families (the bar, fused op, emulations); the
# H100 run of 0006 on three shape families against 0001-0005; the H100 run of 0001-0005 on
# five families; the H100 run of 0001-0005 on V4.1-Flash with its emulations; the H200 run of
# its dispatch before the row-class kernels stopped at the launch's last tile), and the files
# in them (kernel-level A/B, emulations, fused op; tables, JSON, plot, the repeated runs).
# (moe_dispatch/whole-expert-tiles-v2-h200/ and estimated-row-classes-h200/ hold the previous
# series' evidence.)
EVIDENCE_ROOT = "moe_dispatch"
EVIDENCE_DIRS = ("bar-five-families-h100", "wide-cold-tile-h100", "families-h100", "last-tile-h100",
                 "hot-first-h200")  # fmt: skip
EVIDENCE = ("README.md", "NOTES.md", "repeats/README.md", "*_h200.json", "*_h100.json",
            "moe_dispatch.json.gz", "emulated_*.json.gz", "fused.json.gz", "*.png")  # fmt: skip
PR_TITLE = "fused_moe: choose the SM90 FP8 block-scale GEMM kernel from the rows each expert gets"
REPRODUCER = "reproduce_expected_m.py"  # beside the series in patches/flashinfer/
# What each evidence run measured, where it is not the series as shipped.
RUN_NOTES = {"hot-first-h200": "0001-0004, before 0005 (the row-class kernels' stop at the "
             "launch's last tile) and 0006", "families-h100": "0001-0005, before 0006",
             "last-tile-h100": "0001-0005, before 0006 (which changes no case of it: every "
             "swap-A/B tile there is under 120 rows)"}  # fmt: skip
# Where the bug is (FlashInfer 0.6.14 to 0.7.4, read in each release's sources).
BUG_FILE = (
    "csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/"
    "fp8_blockscale_gemm.cu"
)
RULE_FILE = (
    "csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/"
    "fp8_blockscale_gemm_kernel.cuh"
)


def evidence_files(results: Path) -> list[Path]:
    """The evidence files found under `results`, folder by folder in EVIDENCE_DIRS' order."""
    if not results.is_dir():
        return []
    found = []
    for d in EVIDENCE_DIRS:
        run = results / EVIDENCE_ROOT / d
        found += sorted({f for g in EVIDENCE for f in run.glob(g) if f.is_file()})
    return found


def write(out: Path, ps: Sequence[Patch], results: Path) -> list[Path]:
    """Write the series (and each older release's own variant, `v<version>/`) and the evidence
    into OUT, all or nothing; returns the evidence files copied."""
    evidence = evidence_files(results)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out.parent.exists() else None))
    try:
        base = patches_dir() / "flashinfer"  # the shipped series
        for p in sorted(base.glob("*.patch")):
            shutil.copyfile(p, tmp / p.name)
        variants = sorted(d for d in base.glob("v*") if d.is_dir())  # older releases' context
        for variant in variants:
            (tmp / variant.name).mkdir()
            for p in sorted(variant.glob("*.patch")):
                shutil.copyfile(p, tmp / variant.name / p.name)
        (tmp / "evidence").mkdir()
        # Under evidence/ as below the results' moe_dispatch/ (one folder per run).
        names = {e: e.relative_to(results / EVIDENCE_ROOT).as_posix() for e in evidence}
        for e, name in names.items():
            (tmp / "evidence" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(e, tmp / "evidence" / name)
        text = pr_text(ps, evidence, [v.name for v in variants], names)
        (tmp / "PR.md").write_text(text, encoding="utf-8")
        shutil.copyfile(base / REPRODUCER, tmp / REPRODUCER)
        (tmp / "ISSUE.md").write_text(issue_text(base / REPRODUCER, evidence), encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return evidence


def pr_text(
    ps: Sequence[Patch],
    evidence: list[Path],
    variants: Sequence[str] = (),
    names: dict[Path, str] | None = None,
) -> str:
    """PR.md: the series' subjects and commit messages, then the evidence tables."""
    # The PR's title says what the series does as a whole (each commit does one part of it);
    # the list names every commit.
    parts = [f"# {PR_TITLE if len(ps) > 1 else ps[0].subject}", ""]
    if len(ps) > 1:
        parts += [f"{len(ps)} commits, in order:", ""]
        parts += [f"{i}. {p.subject}" for i, p in enumerate(ps, 1)] + [""]
    for p in ps:
        body = p.message
        marker = body.find("\nEvidence:")
        if marker >= 0:
            body = body[:marker].rstrip()
        parts += [body, ""]
    if variants:
        parts += [
            "For a backport to older releases, their own copies of the patches whose context "
            "lines differ (the others apply as they are): "
            + ", ".join(f"`{v}/`" for v in variants)
            + ".",
            "",
        ]
    parts += ["## Evidence", ""]
    tables = [e for e in evidence if e.suffix == ".md"]
    if not tables:
        parts.append("Not measured yet: no benchmark results were found when this was exported.")
    for e in tables:
        title = (names or {}).get(e, e.name).removesuffix(".md")
        parts += [f"### {title}", "", e.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(parts).rstrip() + "\n"


def _reproducer(path: Path):
    spec = importlib.util.spec_from_file_location("reproduce_expected_m", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _measured(evidence: list[Path]) -> list[str]:
    """Lines of numbers from the kernel-level runs among the evidence (the device each ran on,
    the shipped fix against stock), or a line saying none was found."""
    out = []
    for f in evidence:
        if not (f.name == "moe_dispatch.json.gz" or f.name.startswith("kernel_")
                and f.suffix == ".json"):  # fmt: skip
            continue
        try:
            doc = json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else
                             f.read_text())  # fmt: skip
            lead = doc.get("spec", {}).get("lead")  # run.py's JSON: speedups per version
            rows = [r | {"speedup": r["speedups"][lead]} if lead else r for r in doc["ab"]
                    if "speedup" in r or lead in r.get("speedups", {})]  # fmt: skip
            device = doc["device"]["name"]
        except (OSError, ValueError, KeyError, TypeError, EOFError, gzip.BadGzipFile):
            continue
        if not rows:
            continue
        worst = min(rows, key=lambda r: r["speedup"])
        uni = [r["speedup"] for r in rows
               if r["routing"] == "uniform" and 128 <= r["tokens"] <= 2048]  # fmt: skip
        note = f", {RUN_NOTES[f.parent.name]}" if f.parent.name in RUN_NOTES else ""
        ok = sum(r["speedup"] >= 0.98 for r in rows)
        line = (f"- {device} (`{f.parent.name}`{note}): {ok} of {len(rows)} routing x token "
                f"cases at or above 0.98x of the stock choice, worst {worst['speedup']:.3f}x "
                f"({worst['routing']}, {worst['tokens']} tokens)")  # fmt: skip
        if uni:
            line += f"; uniform routing at 128-2,048 tokens {min(uni):.2f}-{max(uni):.2f}x"
        out.append(line + ".")
    return out or ["- No kernel-level run was found beside the patches when this was exported."]


ISSUE = """\
# SM90 FP8 block-scale CUTLASS fused MoE chooses its DeepGEMM kernel from the token \
count, not the rows each expert gets

## Symptom

`cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True)` with expert parallelism
(DeepSeek-V3/V4-style models on EP8) runs the regular grouped GEMM, tiled on M in 64- or 128-row
tiles, for steps of 64 tokens and more on H20 (32 and more elsewhere), although each local expert
then holds a handful of rows: 5 on average at 288 tokens for 384 experts, top-6, EP8. The tiles
are padded with MMA work for rows that do not exist; on H20, whose FP8 tensor rate is low next to
its memory bandwidth, that padding sets the time. The swap-A/B kernel that would read each
expert's weights once at those rows is only taken below the threshold.

## Where

- `{bug_file}`, `CutlassFp8BlockScaleGemmRunner::getWorkspaceSize(shape_m, shape_n, shape_k,
  top_k, num_problems)`: `expected_m_ = shape_m;` (the step's token count; the MoE runner passes
  `num_rows`).
- `{rule_file}`, `grouped_gemm_dispatch`: `m_per_expert_threshold = num_device_sms == 78 ? 64 :
  32`, the regular kernel when `expected_m >= m_per_expert_threshold`.
- Present in flashinfer-python 0.6.14, 0.6.18.post1, 0.7.2.post1 and 0.7.4 (read in each
  release's sources).

## Reproducer

`{reproducer}` (FlashInfer and torch only) times one EP rank's op per token count and prints the
time over the weight-streaming floor; `--dry-run` prints the choices below without a GPU:

    python {reproducer}          # DeepSeek-V4.1-Flash expert shapes, EP8 rank 0
    python {reproducer} --dry-run --sms 78

{tables}
## Numbers

The fix proposed in the accompanying pull request (the average rows per expert for
`expected_m`, then a per-expert choice on the device) against the stock choice, every EP8 rank's
grouped GEMMs in CUDA graphs (median of 24 samples of the slowest rank), outputs checked against
an fp32 reference:

{measured}

Not measured by us on H20: the write-up this work started from reports, on 8xH20 with EP8,
1.808 -> 0.564 ms (3.21x) at 288 uniform tokens for the average-rows estimate alone.
"""


def issue_text(reproducer: Path, evidence: list[Path]) -> str:
    """ISSUE.md: what a FlashInfer maintainer needs to see the bug without vllm-h20."""
    rep = _reproducer(reproducer)
    args = rep.parse(["--dry-run"])
    tables = []
    for sms, gpu in ((78, "H20 (78 SMs)"), (132, "H100/H200 (132 SMs)")):
        tables += [
            f"On {gpu}, threshold {rep.swap_threshold(sms)}:",
            "",
            "| tokens | stock kernel (expected_m = tokens) | rows per expert | kernel for them |",
            "|---:|---|---:|---|",
        ]
        for r in rep.plan(args, sms):
            tables.append(f"| {r['tokens']} | {r['stock_kernel']} | {r['rows_per_expert']} | "
                          f"{r['kernel_for_rows']} |")  # fmt: skip
        tables.append("")
    measured = "\n".join(_measured(evidence))
    return ISSUE.format(bug_file=BUG_FILE, rule_file=RULE_FILE, reproducer=REPRODUCER,
                        tables="\n".join(tables), measured=measured)  # fmt: skip
