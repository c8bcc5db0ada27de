"""GuideLLM's full per-run reports (`runs/<target>/c<N>-r<i>.guidellm.json.gz`, 44 MB of the
published sweeps) are read by nothing: every table comes from the run records beside them. They
live in git history, not in the tree; a manifest keeps each one's checksum and the commit that
holds it, and `fetch` brings them back byte for byte.

    python benchmarks/raw_reports.py out                 # list them in the manifest, untrack them
    python benchmarks/raw_reports.py fetch [PATH ...]    # restore (all, or those under PATH)

The manifest is benchmarks/results/raw-reports.sha256: a `# commit <sha>` line, then
`<sha256>  <path>` per file it holds; a later `out` (a new sweep's reports) adds a section.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

RESULTS = "benchmarks/results"
MANIFEST = f"{RESULTS}/raw-reports.sha256"
PATTERN = "*.guidellm.json.gz"


class RawError(RuntimeError):
    """A refusal with what to do, printed as one line."""


def git(repo: Path, *args: str, binary: bool = False) -> str | bytes:
    p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=not binary)
    if p.returncode:
        err = p.stderr if isinstance(p.stderr, str) else p.stderr.decode(errors="replace")
        raise RawError(f"git {' '.join(args[:2])}: {err.strip()}")
    return p.stdout


def read_manifest(repo: Path) -> dict[str, tuple[str, str]]:
    """{path: (sha256, commit)}: each `# commit <sha>` line holds the files listed after it; a
    line that is neither is refused with its number."""
    f = repo / MANIFEST
    if not f.is_file():
        raise RawError(f"{MANIFEST}: missing; run `python benchmarks/raw_reports.py out` first")
    commit, files = "", {}
    for i, line in enumerate(f.read_text().splitlines(), 1):
        if line.startswith("# commit "):
            commit = line.split()[2]
        elif len(parts := line.split("  ", 1)) == 2 and len(parts[0]) == 64 and commit:
            files[parts[1]] = (parts[0], commit)
        elif line.strip():
            raise RawError(f"{MANIFEST}:{i}: not '<sha256>  <path>' after a '# commit' line: "
                           f"{line[:60]!r}")  # fmt: skip
    return files


def out(repo: Path) -> int:
    """Add every tracked raw report of HEAD to the manifest (under HEAD's commit) and remove it
    from the tree: HEAD keeps it, `fetch` restores it."""
    tracked = git(repo, "ls-files", "--", f"{RESULTS}/{PATTERN}").split()  # `*` spans folders
    if not tracked:
        raise RawError(f"no tracked {PATTERN} under {RESULTS}: nothing to take out")
    if git(repo, "status", "--porcelain", "--", *tracked).strip():
        raise RawError("some raw reports differ from HEAD: commit them first")
    head = git(repo, "rev-parse", "HEAD").strip()
    m = repo / MANIFEST
    text = m.read_text() if m.is_file() else ""
    lines = [f"# commit {head}"]
    for p in sorted(tracked):
        lines.append(f"{hashlib.sha256((repo / p).read_bytes()).hexdigest()}  {p}")
    m.write_text(text + "\n".join(lines) + "\n")
    read_manifest(repo)  # what was written reads back
    git(repo, "rm", "-q", "--", *tracked)
    git(repo, "add", MANIFEST)
    print(f"raw_reports: {len(tracked)} reports listed in {MANIFEST} (commit {head[:12]}) and "
          "removed from the tree; commit the change")  # fmt: skip
    return 0


def fetch(repo: Path, under: list[str]) -> int:
    """Write each listed report (under the given paths, default all) from the manifest's
    commit, checking its sha256 before it lands; one already there and right is skipped."""
    files = read_manifest(repo)
    roots = [u.rstrip("/") for u in under]
    want = {p: h for p, h in files.items()
            if not roots or any(p == u or p.startswith(u + "/") for u in roots)}  # fmt: skip
    if not want:
        raise RawError(f"no listed report under {', '.join(under)}")
    wrote = 0
    for i, (p, (h, commit)) in enumerate(sorted(want.items()), 1):
        dst = repo / p
        if dst.is_file() and hashlib.sha256(dst.read_bytes()).hexdigest() == h:
            continue
        data = git(repo, "cat-file", "blob", f"{commit}:{p}", binary=True)
        if hashlib.sha256(data).hexdigest() != h:
            raise RawError(f"{p}: commit {commit[:12]} holds other bytes than the manifest says")
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(dst)
        wrote += 1
        print(f"\rraw_reports: {i}/{len(want)}", end="", file=sys.stderr)
    print(f"\rraw_reports: {wrote} written, {len(want) - wrote} already there", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, repo: Path | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("out", help="list the raw reports in the manifest and untrack them")
    f = sub.add_parser("fetch", help="restore them from the manifest's commit")
    f.add_argument("paths", nargs="*", help="only those under these paths")
    args = ap.parse_args(argv)
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        return out(repo) if args.cmd == "out" else fetch(repo, args.paths)
    except RawError as e:
        print(f"raw_reports: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
