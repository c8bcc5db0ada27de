"""How far one server's first-token logprobs moved between two leases, measured the way
`probe.py compare` measures two servers against each other (top-20 candidates both leases list,
largest |difference| among them), so the two figures can stand side by side (CPU, stdlib).

    python benchmarks/journey_h200/logprob_drift.py LEASE_A/check/compare_X-Y.json \
        LEASE_B/check/compare_X-Y.json --server v4hum
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def drift(a: dict, b: dict, server: str) -> list[dict]:
    """Per prompt: candidates both leases list for `server`, and the largest |difference|."""
    if server not in a["servers"] or a["servers"] != b["servers"]:
        raise ValueError(f"{server!r} must be one of both files' servers ({a['servers']})")
    side = a["servers"].index(server)
    rows = []
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        if ra["prompt"] != rb["prompt"]:
            raise ValueError(f"the two files ask different prompts: {ra['prompt']!r}")
        ta, tb = ra["first_token_top20"][side], rb["first_token_top20"][side]
        common = set(ta) & set(tb)
        rows.append({"prompt": ra["prompt"], "common": len(common),
                     "max_abs_diff": max(abs(ta[k] - tb[k]) for k in common)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--server", required=True)
    a = ap.parse_args(argv)
    try:
        rows = drift(json.loads(a.before.read_text()), json.loads(a.after.read_text()), a.server)
    except (OSError, ValueError, KeyError) as e:
        print(f"logprob_drift: {e}", file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r['common']:2d} shared, max |diff| {r['max_abs_diff']:.3f}  {r['prompt'][:50]}")
    moved = [r for r in rows if r["max_abs_diff"] > 0]
    print(f"{a.server}: moved on {len(moved)} of {len(rows)} prompts, "
          f"{min(r['common'] for r in rows)}-20 candidates shared, max |diff| "
          f"{max(r['max_abs_diff'] for r in rows):.2f} nats")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
