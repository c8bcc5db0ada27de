"""Converter throughput against a plain copy of the same bytes on the same disk.

    python benchmarks/convert/bench_convert.py --workdir /tmp/vllm-h20-bench [--workers 1 2]

Generates (once) a >= 2 GiB V4.1-layout checkpoint with the real matrix shapes, then times
  copy:    read every input byte and write as many bytes as the conversion writes, fsync
  convert: `vllm-h20 convert` with each worker count (fresh DST each time)
  verify:  with --verify, `vllm-h20 verify` of that output with the same worker count
each from a cold page cache where the machine allows dropping it (root), else warm, and
prints convert / copy, peak RSS of the converter (parent + largest worker) and scaling with
workers. Writes a JSON record with --json-out. Not a test: no thresholds, just the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
CHUNK = 16 * 2**20


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def plain_copy(src: Path, dst: Path, out_bytes: int) -> float:
    """Read all of src's files and write out_bytes in total to dst, then fsync."""
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    written = 0
    files = sorted(p for p in src.iterdir() if p.is_file())
    for i, p in enumerate(files):
        left_files = len(files) - i
        target = (out_bytes - written) // left_files
        with open(p, "rb") as f, open(dst / p.name, "wb") as g:
            n = 0
            buf = f.read(CHUNK)
            last = buf
            while buf:
                g.write(buf)
                n += len(buf)
                last = buf
                buf = f.read(CHUNK)
            while n < target and last:  # pad to the conversion's output volume
                piece = last[: target - n]
                g.write(piece)
                n += len(piece)
            g.flush()
            os.fsync(g.fileno())
        written += n
    return time.perf_counter() - t0


def run_convert(src: Path, dst: Path, workers: int) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "vllm_h20.cli", "convert", str(src), str(dst)]
    cmd += ["-j", str(workers), "-q"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    secs = time.perf_counter() - t0
    return secs, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def run_verify(src: Path, dst: Path, workers: int) -> float:
    cmd = [sys.executable, "-m", "vllm_h20.cli", "verify", str(src), str(dst)]
    cmd += ["-j", str(workers)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def time_converts(
    src: Path, workdir: Path, workers: list[int], verify: bool
) -> tuple[list[dict], int | None]:
    """`vllm-h20 convert` (and verify) of src at each worker count, page cache dropped first
    where allowed; the runs and the output's size."""
    runs = []
    out_bytes = None
    for w in workers:
        dst = workdir / f"fp8-j{w}"
        shutil.rmtree(dst, ignore_errors=True)
        cold = drop_caches()
        secs, rss = run_convert(src, dst, w)
        out_bytes = dir_bytes(dst)
        run = {
            "workers": w,
            "seconds": round(secs, 2),
            "cold_cache": cold,
            "peak_rss_bytes_children": rss,
        }
        if verify:
            drop_caches()
            run["verify_seconds"] = round(run_verify(src, dst, w), 2)
        runs.append(run)
        shutil.rmtree(dst)
    return runs, out_bytes


def print_table(runs: list[dict], bytes_in: int, copy_s: float) -> None:
    """Each run's time, input rate and ratio to the plain copy (recorded into the runs)."""
    print(f"{'run':<14}{'seconds':>9}{'MiB/s in':>10}{'vs copy':>9}{'peak RSS':>11}")
    print(f"{'copy':<14}{copy_s:>9.2f}{bytes_in / copy_s / 2**20:>10.0f}{1.0:>9.2f}{'-':>11}")
    for r in runs:
        s = r["seconds"]
        r["ratio_vs_copy"] = round(s / copy_s, 3)
        print(
            f"{'convert -j' + str(r['workers']):<14}{s:>9.2f}{bytes_in / s / 2**20:>10.0f}"
            f"{s / copy_s:>9.2f}{r['peak_rss_bytes_children'] / GIB:>9.2f} G"
        )
    for r in runs:  # verify re-reads the input and the output: the same copy as baseline
        if "verify_seconds" in r:
            v = r["verify_seconds"]
            r["verify_ratio_vs_copy"] = round(v / copy_s, 3)
            print(
                f"{'verify -j' + str(r['workers']):<14}{v:>9.2f}{bytes_in / v / 2**20:>10.0f}"
                f"{v / copy_s:>9.2f}{'-':>11}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/vllm-h20-bench"))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (size knob)")
    ap.add_argument("--verify", action="store_true", help="also time `vllm-h20 verify`")
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()

    from vllm_h20 import __version__
    from vllm_h20.convert.synth import generate, scaled

    src = a.workdir / "src"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        info = generate(src, scaled("bench", experts=a.experts), shards=8, spread=6)
        print(f"generated {info['bytes'] / GIB:.2f} GiB in {src}")
    bytes_in = dir_bytes(src)

    runs, out_bytes = time_converts(src, a.workdir, a.workers, a.verify)

    copy_dst = a.workdir / "copy"
    shutil.rmtree(copy_dst, ignore_errors=True)
    cold = drop_caches()
    copy_s = plain_copy(src, copy_dst, out_bytes)
    shutil.rmtree(copy_dst)

    print(
        f"input {bytes_in / GIB:.2f} GiB, output {out_bytes / GIB:.2f} GiB, "
        f"cold cache: {cold}, cpus: {os.cpu_count()}"
    )
    print_table(runs, bytes_in, copy_s)
    doc = {
        "benchmark": "convert vs plain copy",
        "command": " ".join(["python", *sys.argv]),
        "tool": f"vllm-h20 {__version__}",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "bytes_in": bytes_in,
        "bytes_out": out_bytes,
        "copy_seconds": round(copy_s, 2),
        "copy_cold_cache": cold,
        "runs": runs,
        "note": "peak RSS: ru_maxrss of RUSAGE_CHILDREN, the largest single process over all "
        "runs so far, including file pages mapped from SRC (reclaimable page cache)",
    }
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
