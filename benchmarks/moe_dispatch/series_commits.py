"""The FlashInfer series as a maintainer takes it: one commit per patch file, each applied with
`git am` to every supported release and each one building on its own (CPU, nvcc).

    python benchmarks/moe_dispatch/series_commits.py am --wheel W.whl [--wheel ...] [--tag-repo R]
    python benchmarks/moe_dispatch/series_commits.py build --work DIR

`am`: per release, a git repository (the FlashInfer clone's tag v<version> with --tag-repo, else
a wheel's flashinfer/data, which holds every source the series touches; a wheel ships no tests/,
which 0001 creates) and `git am` of the release's series (patches/flashinfer/, its v<version>/
variant first). `build`: per prefix of the series on the installed FlashInfer, the grouped GEMM's
host source (fp8_blockscale_gemm.cu, run.py's nvcc flags) and, once row classes exist, a
swap-A/B and a regular row-class kernel written by the patched generateKernel and compiled with
DeepGEMM's own flags. One line per release or prefix; exit 1 when one failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from vllm_h20.moe import overlay  # noqa: E402

GIT = ["git", "-c", "user.name=series check", "-c", "user.email=check@localhost"]


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True)


def am(root: Path, version: str, base: str) -> str:
    """`git am` of the release's series on `root` (a repository at the release); one line."""
    files = [str(f) for f in overlay.series_files(version)]
    start = git(root, "rev-parse", "HEAD").stdout.strip()
    r = git(root, "am", "--quiet", *files)
    if r.returncode:
        why = (r.stderr or r.stdout).strip().splitlines()[:2]
        return f"FAIL {version} ({base}): git am: {' '.join(why)}"
    n = git(root, "rev-list", "--count", f"{start}..HEAD").stdout.strip()
    names = ", ".join(Path(f).name[:4] for f in files)
    return f"ok {version} ({base}): {n} commits applied ({names})"


def from_wheel(wheel: Path, work: Path) -> tuple[str, Path]:
    parts = wheel.name.split("-")
    if not wheel.is_file() or parts[0] != "flashinfer_python" or len(parts) < 3:
        raise SystemExit(f"series_commits: {wheel}: not a flashinfer_python-<version>-*.whl file "
                         "(pip download --no-deps flashinfer-python==<version>)")  # fmt: skip
    version = parts[1]
    root = work / f"wheel-{version}"
    try:
        z = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        why = "not a zip archive (a truncated download?)"
        raise SystemExit(f"series_commits: {wheel}: {why}") from None
    with z:
        for name in z.namelist():
            if name.startswith("flashinfer/data/") and not name.endswith("/"):
                dest = root / name[len("flashinfer/data/") :]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(name))
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-qm", f"flashinfer {version} wheel")):
        git(root, *args).check_returncode()
    return version, root


def from_tag(repo: Path, version: str, work: Path) -> Path:
    root = work / f"tag-{version}"
    r = subprocess.run(["git", "clone", "-q", "--no-checkout", str(repo), str(root)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode == 0:
        r = git(root, "checkout", "-q", f"v{version}")
    if r.returncode:
        why = r.stderr.strip().splitlines()[-1:] or ["?"]
        raise SystemExit(f"series_commits: {repo}: no tag v{version} to check out ({why[0]}); "
                         "pass a FlashInfer clone with its tags (git fetch --tags)")  # fmt: skip
    return root


def cmd_am(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="series-am-"))
    lines = []
    for tag in args.tag:
        lines.append(am(from_tag(args.tag_repo, tag, work), tag, f"git tag v{tag}"))
    for wheel in args.wheel:
        version, root = from_wheel(wheel, work)
        lines.append(am(root, version, f"{wheel.name}'s data"))
    print("\n".join(lines))
    return 0 if lines and all(x.startswith("ok") for x in lines) else 1


def cmd_build(args) -> int:
    import modules

    from tests.moe import deepgemm_kernels as dk
    from vllm_h20.moe import build, flashinfer_src

    fi = flashinfer_src.installed()
    patches, files = overlay.shipped_patches(fi.version), overlay.series_files(fi.version)
    failed = 0
    for k in range(1, len(patches) + 1):
        t0, w = time.time(), args.work / f"prefix-{k}"
        w.mkdir(parents=True, exist_ok=True)
        csrc = dk.overlay_csrc(fi, patches[:k], w)
        nv = csrc / "nv_internal"
        includes = modules.include_dirs(nv, fi.root)
        cublas = build.find_cublas_include(build.find_cuda_home())
        flags = [*modules.NVCC_FLAGS, "-DVLLM_H20_PATCHED", *(f"-I{i}" for i in includes),
                 *(["-isystem", cublas] if cublas else [])]  # fmt: skip
        r = subprocess.run([dk.nvcc(), "-c", str(nv / modules.GEMM_CU), "-o", str(w / "gemm.o"),
                            *flags], capture_output=True, text=True)  # fmt: skip
        ok = r.returncode == 0
        notes = ["fp8_blockscale_gemm.cu " + ("compiled" if ok else "FAILED: " + r.stderr[-600:])]
        if ok and "RowClass" in (nv / "tensorrt_llm/deep_gemm/compiler.cuh").read_text():
            classes = {"swap": ["swap", "1", "24"], "regular": ["regular", "25", "any"]}
            src = dk.generate(dk.GEN, classes, csrc, fi, w)
            for name in ("swap", "regular"):
                c = dk.compile_kernel(src[name], nv / "tensorrt_llm", w, name)
                ok = ok and c.returncode == 0
                notes.append(
                    f"{name} kernel{src[name + '_tag']} "
                    + ("compiled" if c.returncode == 0 else "FAILED: " + c.stderr[-600:])
                )
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} {fi.version} {k}/{len(patches)} {files[k - 1].name}: "
              f"{'; '.join(notes)} ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("am", help="git am onto each release")
    a.add_argument("--wheel", type=Path, action="append", default=[], help="a flashinfer wheel")
    a.add_argument("--tag", action="append", default=[], help="a release tagged in --tag-repo")
    a.add_argument("--tag-repo", type=Path, help="a FlashInfer git clone with its tags")
    b = sub.add_parser("build", help="each prefix of the series compiled (installed FlashInfer)")
    b.add_argument("--work", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "am" and args.tag and not args.tag_repo:
        ap.error("--tag needs --tag-repo")
    return cmd_am(args) if args.cmd == "am" else cmd_build(args)


if __name__ == "__main__":
    sys.exit(main())
