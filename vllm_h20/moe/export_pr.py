"""`patches export`: the shipped patch series and its measured evidence laid out for an upstream
pull request (patch files for `git am`, PR.md, the evidence files)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .overlay import series_dir
from .patchfile import Patch

# The published results that are the patch's evidence, relative to the results folder: the
# kernel-level dispatch A/B and the fused-op A/B (tables, JSON, plots).
EVIDENCE = ("moe_dispatch_*", "fused_moe_*")


def evidence_files(results: Path) -> list[Path]:
    if not results.is_dir():
        return []
    return sorted({f for g in EVIDENCE for f in results.glob(g) if f.is_file()})


def write(out: Path, ps: Sequence[Patch], results: Path) -> list[Path]:
    """Write the series (and each older release's own variant, `v<version>/`) and the evidence
    into OUT, all or nothing; returns the evidence files copied."""
    evidence = evidence_files(results)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out.parent.exists() else None))
    try:
        base = series_dir()  # the shipped series, or $VLLM_H20_PATCH_SERIES's
        for p in sorted(base.glob("*.patch")):
            shutil.copyfile(p, tmp / p.name)
        variants = sorted(d for d in base.glob("v*") if d.is_dir())  # older releases' context
        for variant in variants:
            (tmp / variant.name).mkdir()
            for p in sorted(variant.glob("*.patch")):
                shutil.copyfile(p, tmp / variant.name / p.name)
        (tmp / "evidence").mkdir()
        for e in evidence:
            shutil.copyfile(e, tmp / "evidence" / e.name)
        text = pr_text(ps, evidence, [v.name for v in variants])
        (tmp / "PR.md").write_text(text, encoding="utf-8")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return evidence


def pr_text(ps: Sequence[Patch], evidence: list[Path], variants: Sequence[str] = ()) -> str:
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
        parts += [f"### {e.stem}", "", e.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(parts).rstrip() + "\n"
