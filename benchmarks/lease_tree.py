"""Keep the working tree that travels with every device call small: `benchmarks/results/` (the
published runs, ~50 MB and growing) is read by nothing on the GPU machine, yet the device tool
sends every tracked file with every call, leaving little of its 64 MiB for the FlashInfer
sources or the wheels a lease carries.

    python benchmarks/lease_tree.py size .fi .stage/piece-00   # what a call would send
    python benchmarks/lease_tree.py out     # before the lease: results leave the tree
    python benchmarks/lease_tree.py back    # after it: results and the index as they were

`out` untracks the folder (`git rm -r --cached`, nothing deleted), moves it to `.lease/results`
and lists both in `.git/info/exclude`; until `back`, a pre-commit hook refuses a commit that
would record the untracking as deleting every result (commit other files by name meanwhile).
`back` moves the folder home, keeps any file written to `benchmarks/results/` during the lease
(a rendered run), re-tracks the published files and removes the exclude lines and the hook.
Round 5 of the serving benchmark did this by hand: the tree fell from 49 MB to 1.8 MB and the
wheels travelled in 6 pieces instead of 25.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

CARRY_LIMIT = 64 << 20  # the device tool's limit per call: working tree + carried paths
RESULTS = "benchmarks/results"
ASIDE = ".lease/results"
EXCLUDE = ("/.lease/", f"/{RESULTS}/")
HOOK_MARK = "# vllm-h20 lease_tree.py"
# Refuses only a commit that would delete published results (a plain `git commit` while they are
# out); `git commit PATH...` of other files goes through.
HOOK = f"""#!/bin/sh
{HOOK_MARK}: {RESULTS} is out of the tree for a device lease
if git diff --cached --name-only --diff-filter=D -- {RESULTS} | grep -q .; then
  echo "lease_tree: {RESULTS} is out of the tree for a device lease: this commit would" >&2
  echo "delete every published result. Run  python benchmarks/lease_tree.py back  first," >&2
  echo "or commit other files by name (git commit PATH...)" >&2
  exit 1
fi
exit 0
"""


class LeaseTreeError(RuntimeError):
    """A refusal with what to do, printed as one line."""


def git(repo: Path, *args: str) -> str:
    p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if p.returncode:
        raise LeaseTreeError(f"git {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def toplevel(start: Path) -> Path:
    return Path(git(start, "rev-parse", "--show-toplevel").strip())


def tree_bytes(repo: Path) -> int:
    """Bytes of what travels with every device call: tracked and untracked, not ignored."""
    out = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    files = (repo / f for f in out.split("\0") if f)
    return sum(f.stat().st_size for f in files if f.is_file())


def path_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _paths(repo: Path) -> tuple[Path, Path, Path, Path]:
    """The folder, where it goes aside, git's exclude file and pre-commit hook (where git reads
    them, core.hooksPath included)."""
    exclude, hook = (repo / git(repo, "rev-parse", "--git-path", p).strip()
                     for p in ("info/exclude", "hooks/pre-commit"))  # fmt: skip
    return repo / RESULTS, repo / ASIDE, exclude, hook


def is_out(repo: Path) -> bool:
    return _paths(repo)[1].exists()


def take_out(repo: Path) -> int:
    """Untrack and move benchmarks/results/ aside; returns the files moved."""
    results, aside, exclude, hook = _paths(repo)
    if aside.exists():
        raise LeaseTreeError(f"{ASIDE} exists: the results are already out (`back` restores them)")
    if not results.is_dir():
        raise LeaseTreeError(f"{RESULTS}/ not found in {repo}")
    dirty = git(repo, "status", "--porcelain", "--untracked-files=all", "--", RESULTS)
    if dirty.strip():
        first = dirty.splitlines()[0]
        raise LeaseTreeError(f"{RESULTS} has uncommitted changes ({first.strip()} ...): "
                             "commit or stash them first")  # fmt: skip
    if hook.exists() and HOOK_MARK not in hook.read_text():
        raise LeaseTreeError(f"{hook} is someone else's pre-commit hook: move it away first")
    tracked = [f for f in git(repo, "ls-files", "-z", "--", RESULTS).split("\0") if f]
    git(repo, "rm", "-r", "-q", "--cached", "--", RESULTS)
    aside.parent.mkdir(exist_ok=True)
    shutil.move(str(results), str(aside))
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    exclude.write_text("\n".join([*lines, *(e for e in EXCLUDE if e not in lines)]) + "\n")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(HOOK)
    hook.chmod(0o755)
    return len(tracked)


def bring_back(repo: Path) -> tuple[int, list[str]]:
    """Undo take_out; returns (files restored, files written meanwhile and kept)."""
    results, aside, exclude, hook = _paths(repo)
    if not aside.exists():
        raise LeaseTreeError(f"{ASIDE} not found: the results are not out")
    kept: list[str] = []
    if results.exists():
        # Written during the lease (a rendered run): merged into the restored folder, never
        # over a published file.
        for f in sorted(p for p in results.rglob("*") if p.is_file()):
            rel = f.relative_to(results)
            if (aside / rel).exists():
                raise LeaseTreeError(f"{RESULTS}/{rel} was written during the lease and is also "
                                     f"a published file: move one of them, then run `back` "
                                     f"again")  # fmt: skip
            kept.append(str(rel))
        for rel in kept:
            (aside / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(results / rel), str(aside / rel))
        shutil.rmtree(results)
    shutil.move(str(aside), str(results))
    if aside.parent.exists() and not any(aside.parent.iterdir()):
        aside.parent.rmdir()
    if exclude.exists():
        lines = [ln for ln in exclude.read_text().splitlines() if ln not in EXCLUDE]
        exclude.write_text("\n".join(lines) + "\n" if lines else "")
    if hook.exists() and HOOK_MARK in hook.read_text():
        hook.unlink()
    git(repo, "reset", "-q", "--", RESULTS)
    restored = [f for f in git(repo, "ls-files", "-z", "--", RESULTS).split("\0") if f]
    return len(restored), kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    size = sub.add_parser("size", help="bytes a device call would send, with these carried paths")
    size.add_argument("carry", nargs="*", type=Path, help="paths named in the call's carry")
    sub.add_parser("out", help="benchmarks/results/ leaves the working tree for a lease")
    sub.add_parser("back", help="benchmarks/results/ back, tracked as before")
    a = ap.parse_args(argv)
    try:
        repo = toplevel(Path.cwd())
        if a.cmd == "size":
            tree = tree_bytes(repo)
            missing = [str(p) for p in a.carry if not p.exists()]
            if missing:
                raise LeaseTreeError(f"carry path(s) not found: {', '.join(missing)}")
            carried = {str(p): path_bytes(p) for p in a.carry}
            total = tree + sum(carried.values())
            state = " (results out)" if is_out(repo) else ""
            print(f"working tree{state}: {tree / 2**20:7.1f} MiB")
            for p, n in carried.items():
                print(f"carry {p}: {n / 2**20:7.1f} MiB")
            verdict = "fits" if total <= CARRY_LIMIT else "over the device tool's limit"
            print(f"total: {total / 2**20:.1f} of {CARRY_LIMIT >> 20} MiB: {verdict}")
            return 0 if total <= CARRY_LIMIT else 1
        if a.cmd == "out":
            n = take_out(repo)
            print(f"lease_tree: {n} files of {RESULTS} moved to {ASIDE} and untracked; "
                  f"working tree now {tree_bytes(repo) / 2**20:.1f} MiB; until `python "
                  f"benchmarks/lease_tree.py back`, commit other files by name only")  # fmt: skip
            return 0
        n, kept = bring_back(repo)
        extra = f"; kept {len(kept)} file(s) written meanwhile (untracked)" if kept else ""
        print(f"lease_tree: {RESULTS} back, {n} files tracked as before{extra}")
        return 0
    except LeaseTreeError as e:
        print(f"lease_tree: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
