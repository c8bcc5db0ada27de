"""The conversion report: per rule group, how many tensors, how exact, how many bytes."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..console import make_console
from .blockscale import Stats

REPORT = "conversion_report.json"
GIB = 1024**3


def merge_groups(results: list[dict[str, Stats]]) -> dict[str, Stats]:
    out: dict[str, Stats] = {}
    for groups in results:
        for g, s in groups.items():
            out.setdefault(g, Stats()).add(s)
    return dict(sorted(out.items()))


def build(groups: dict[str, Stats], ops: dict[str, str], extra: dict) -> dict:
    """The JSON document; ``extra`` carries run facts (paths, bytes, versions, time)."""
    return {
        "groups": {g: {"op": ops.get(g, "keep"), **s.to_json()} for g, s in groups.items()},
        **extra,
    }


def write(dst: Path, doc: dict) -> None:
    tmp = dst / f".{REPORT}.partial"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(dst / REPORT)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_err(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def render(doc: dict, console: Console | None = None, title: str = "Conversion report") -> None:
    console = console or make_console()
    t = Table(title=title, title_justify="left")
    for col in (
        "group",
        "op",
        "tensors",
        "bit-exact",
        "inexact elems",
        "max |err|",
        "rel L2",
        "neg-zero codes",
    ):
        t.add_column(col, justify="left" if col in ("group", "op") else "right")
    for g, s in doc["groups"].items():
        converted = s["op"] != "keep"
        t.add_row(
            g,
            s["op"],
            f"{s['tensors']:,}",
            f"{100 * s['exact_fraction']:.6f} %" if converted else "bytes",
            f"{s['inexact']:,}" if converted else "-",
            _fmt_err(s["max_abs_err"]) if converted else "-",
            _fmt_err(s["rel_l2"]) if converted else "-",
            f"{s['neg_zero']:,}" if converted else "-",
        )
    console.print(t)
    if "bytes_in" in doc:
        secs = doc.get("seconds", 0.0)
        console.print(
            f"bytes in {human_bytes(doc['bytes_in'])} -> out {human_bytes(doc['bytes_out'])}"
            + (
                f" in {secs:.1f} s ({doc['bytes_in'] / max(secs, 1e-9) / 2**20:.0f} MiB/s in)"
                if secs
                else ""
            )
        )
