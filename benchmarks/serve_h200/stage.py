"""Stage what the GPU machine needs into .stage/ (run where PyPI is reachable): the wheels of
wheels.txt for Python 3.12 x86-64, vllm-h20's own wheel, and the test model's directory, packed
so that each device call carries one piece under its 64 MiB limit, the working tree included.

- `.stage/boot.tar`: FlashInfer, TVM FFI, vllm-h20 and the model (~17 MB): enough to start
  building the fix modules while the rest travels;
- `.stage/piece-NN`: the other wheels, one tar split into pieces sized so that a piece and the
  working tree (tracked and untracked files, which travel with every call) fit 64 MiB
  (`h200.sh take` moves each away on arrival; `h200.sh install` joins them); with
  `--jit-cache DIR`, a previous lease's JIT caches (`h200.sh jitsave`) travel in them too.

    python benchmarks/serve_h200/stage.py   # then carry .stage/boot.tar, .stage/piece-00, ...
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from lease_tree import CARRY_LIMIT, tree_bytes  # noqa: E402

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]  # fmt: skip
# What `kernels build` needs besides torch, and ml_dtypes, the one dependency of `synth` and
# `convert` the GPU image lacks: the V4 journey then prepares its checkpoints right after boot.
BOOT = ("flashinfer_python-", "apache_tvm_ffi-", "ml_dtypes-")
MARGIN = 2 << 20


def piece_bytes(tree: int) -> int:
    """The largest piece that travels beside the working tree, in whole MiB."""
    room = (CARRY_LIMIT - tree - MARGIN) >> 20
    if room < 8:
        raise SystemExit(
            f"the working tree is {tree / 2**20:.1f} MiB: no room left for pieces "
            "under the device tool's 64 MiB; `python benchmarks/lease_tree.py out` takes the "
            "published results out of it for the lease"
        )
    return room << 20


def check_python() -> None:
    """Refuse, before anything is downloaded, a Python without `tokenizers`: make_model.py
    writes the test model's tokenizer with it (round 6 staged a traceback otherwise)."""
    if importlib.util.find_spec("tokenizers") is None:
        raise SystemExit(
            f"stage: {sys.executable} has no `tokenizers` package, which make_model.py needs "
            "for the model's tokenizer: `pip install tokenizers`, or run stage.py with a Python "
            "that has it (e.g. the CI venv's)"
        )


def requirements(extra: list[Path] = ()) -> list[str]:
    """wheels.txt plus any --extra lists (the V4 journey's), comments dropped."""
    for f in extra:
        if not f.is_file():
            raise SystemExit(f"--extra {f}: no such wheel list (one `name==version` a line)")
    lines = [ln for f in (HERE / "wheels.txt", *extra) for ln in f.read_text().splitlines()]
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def download(dest: Path, extra: list[Path] = ()) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest),
           *requirements(extra)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _wanted(wheel: str, reqs: list[str]) -> bool:
    """Whether a downloaded wheel is one the lists pin (.stage/wheels may hold others)."""
    dist, version = wheel.split("-")[:2]
    return any(_norm(r.split("==")[0]) == _norm(dist) and r.split("==")[-1] == version
               for r in reqs if "==" in r)  # fmt: skip


def jit_pieces(d: Path) -> list[Path]:
    """The pieces of one `h200.sh jitsave` (jit-cache.tgz, or .00, .01, ...), in order."""
    found = sorted(d.glob("jit-cache.tgz*"))
    if not found:
        raise SystemExit(f"stage: --jit-cache {d}: no jit-cache.tgz* there (what `h200.sh "
                         "jitsave OUT` writes to OUT)")  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", type=Path, default=REPO / ".stage")
    ap.add_argument("--layers", type=int, default=None, help="model layers (make_model.py)")
    ap.add_argument("--extra", type=Path, action="append", default=[],
                    help="another wheel list (benchmarks/journey_h200/wheels.txt)")  # fmt: skip
    ap.add_argument("--jit-cache", type=Path, default=None, metavar="DIR",
                    help="a previous lease's JIT caches (the jit-cache.tgz* `h200.sh jitsave` "
                         "wrote): packed with the wheels, restored by `install`")  # fmt: skip
    ap.add_argument("--piece-mib", type=int, default=None,
                    help="piece size (default: what fits beside the working tree)")  # fmt: skip
    a = ap.parse_args(argv)
    check_python()
    jit = jit_pieces(a.jit_cache) if a.jit_cache else []
    tree = tree_bytes(REPO)
    piece = a.piece_mib << 20 if a.piece_mib else piece_bytes(tree)
    if tree > 16 << 20:
        print(f"stage: the working tree is {tree / 2**20:.1f} MiB and travels with every call; "
              f"`python benchmarks/lease_tree.py out` first gives {piece_bytes(2 << 20) >> 20} "
              f"MiB pieces instead of {piece >> 20}")  # fmt: skip
    st = a.stage
    wheels, boot = st / "wheels", st / "boot"
    download(wheels, a.extra)
    shutil.rmtree(boot, ignore_errors=True)
    boot.mkdir(parents=True)
    for w in wheels.glob("*.whl"):
        if w.name.startswith(BOOT):
            shutil.copy2(w, boot / w.name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(boot),
                    str(REPO)], check=True)  # fmt: skip
    model = st / "model"
    shutil.rmtree(model, ignore_errors=True)
    extra = ["--layers", str(a.layers)] if a.layers else []
    subprocess.run([sys.executable, str(HERE / "make_model.py"), str(model), *extra], check=True)

    reqs = requirements(a.extra)
    rest = sorted(w for w in wheels.glob("*.whl") if not w.name.startswith(BOOT)
                  and _wanted(w.name, reqs))  # fmt: skip
    bundle = st / "bundle.tar"
    with tarfile.open(bundle, "w") as t:
        for w in rest:
            t.add(w, arcname=f"wheels/{w.name}")
        for j in jit:
            t.add(j, arcname=f"jit/{j.name}")
    for old in st.glob("piece-*"):
        old.unlink()
    n = 0
    with open(bundle, "rb") as f:
        while chunk := f.read(piece):
            (st / f"piece-{n:02d}").write_bytes(chunk)
            n += 1
    bundle.unlink()
    (boot / "pieces.txt").write_text(f"{n}\n")
    with tarfile.open(st / "boot.tar", "w") as t:
        t.add(boot, arcname="boot")
        t.add(model, arcname="model")
    size = (st / "boot.tar").stat().st_size
    print(f"{st}/boot.tar ({size / 2**20:.1f} MiB) and {n} pieces of <= {piece >> 20} MiB "
          f"({len(rest)} wheels{', the JIT caches' if jit else ''})")  # fmt: skip


if __name__ == "__main__":
    main()
