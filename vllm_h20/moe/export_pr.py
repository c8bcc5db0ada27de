"""`patches export`: the shipped patch series and its measured evidence laid out for an upstream
pull request (patch files for `git am`, PR.md, the evidence files)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .overlay import patches_dir
from .patchfile import Patch

# The shipped series' evidence: its run folders under the results folder, newest first (the
# H100 run of the series as it is; the H200 run of its dispatch before the row-class kernels
# stopped at the launch's last tile), and the files in them (kernel-level A/B, emulations, fused
# op; tables, JSON, plot, the repeated runs). (moe_dispatch/whole-expert-tiles-v2-h200/ and
# estimated-row-classes-h200/ hold the previous series' evidence.)
EVIDENCE_ROOT = "moe_dispatch"
EVIDENCE_DIRS = ("last-tile-h100", "hot-first-h200")
EVIDENCE = ("README.md", "repeats/README.md", "*_h200.json", "*_h100.json", "*.png")


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
    # The series' last commit says what the PR as a whole does; the list names every commit.
    parts = [f"# {ps[-1].subject}", ""]
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
            "The same change for older releases (other context lines only), for a backport: "
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
