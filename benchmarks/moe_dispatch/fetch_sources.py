"""Make the FlashInfer source tarball run.py needs on the GPU machine (which has no network).

    python benchmarks/moe_dispatch/fetch_sources.py   # -> .fi/flashinfer-<version>-src.tar.xz

Downloads the flashinfer-python wheel with pip and keeps only what fp8_blockscale_gemm.cu
compiles against (~2 MB compressed, well inside the device tool's 64 MiB carry limit).
Name `.fi` in the device call's `carry`; it is git-ignored."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

KEEP = ("csrc/nv_internal", "include", "cutlass/include", "cutlass/tools/util/include",
        "spdlog/include")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--version", default="0.7.2.post1", help="flashinfer-python version")
    ap.add_argument("--out", type=Path, default=Path(".fi"))
    args = ap.parse_args()
    out = args.out / f"flashinfer-{args.version}-src.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-d", tmp, f"flashinfer-python=={args.version}"], check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("flashinfer_python-*.whl")
        root = Path(tmp) / "x"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        data = root / "flashinfer" / "data"
        args.out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz") as t:
            for part in KEEP:
                t.add(data / part, arcname=part)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
