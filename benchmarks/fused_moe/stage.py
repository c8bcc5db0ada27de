"""Stage what the GPU machine needs for the fused-MoE proof (it has torch and nvcc, no network).

    python benchmarks/fused_moe/stage.py --flashinfer-repo ~/src/flashinfer   # -> .fi/

writes, under .fi/ (git-ignored; name it in the device call's `carry`):

- wheels/: flashinfer-python (default 0.6.14, vLLM 0.26.0's pin) and apache-tvm-ffi for
  CPython 3.12, installed there with `pip install --no-deps --target`;
- flashinfer-tests/: FlashInfer's own tests for that release, from a FlashInfer git checkout
  (the wheel ships none): the SM90 block-scale `cutlass_fused_moe` test file and what it
  imports, plus the test our patch series adds, written from the patch.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vllm_h20.moe.overlay import shipped_patches  # noqa: E402
from vllm_h20.moe.patchfile import apply_file  # noqa: E402

TESTS = ("tests/__init__.py", "tests/conftest.py", "tests/moe/__init__.py", "tests/moe/utils.py",
         "tests/moe/test_trtllm_cutlass_fused_moe.py", "tests/test_helpers")  # fmt: skip
TVM_FFI = "apache-tvm-ffi==0.1.10"  # vLLM 0.26.0's pin; FlashInfer 0.6.14 accepts it
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")  # fmt: skip


def download(spec: str, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), spec]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or ["?"]
        raise SystemExit(f"error: pip download {spec} failed ({why[0]})")


def export_tests(repo: Path, tag: str, dest: Path, version: str) -> list[str]:
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", tag, *TESTS],
                          capture_output=True)  # fmt: skip
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise SystemExit(f"error: {repo}: cannot export {tag}'s tests ({why[0]}); pass a "
                         f"FlashInfer clone that has the tag (git fetch --tags)")  # fmt: skip
    archive = proc.stdout
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(dest, filter="data")
    added = []
    for patch in shipped_patches(version):  # in order: a later patch may change an added test
        for diff in patch.files:
            if not diff.path.startswith("tests/"):
                continue
            target = dest / diff.path
            before = target.read_text() if target.is_file() else None
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(apply_file(diff, before))
            if diff.path not in added:
                added.append(diff.path)
    return added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--flashinfer-repo", type=Path, required=True, help="a FlashInfer git clone")
    ap.add_argument("--version", default="0.6.14", help="flashinfer-python release")
    ap.add_argument("--out", type=Path, default=REPO / ".fi")
    args = ap.parse_args()
    wheels = args.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    download(f"flashinfer-python=={args.version}", wheels)
    download(TVM_FFI, wheels)
    added = export_tests(args.flashinfer_repo, f"v{args.version}", args.out / "flashinfer-tests",
                         args.version)  # fmt: skip
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"staged {args.out}: {', '.join(p.name for p in wheels.iterdir())}; FlashInfer "
          f"v{args.version} tests + {', '.join(added)}; {size / 2**20:.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
