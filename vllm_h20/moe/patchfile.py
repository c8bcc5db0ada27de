"""Read `git format-patch` files and apply them to text, the way `git apply` does.

The plugin must patch FlashInfer's sources on machines without git (the vLLM image), so we
apply unified diffs ourselves: exact context, hunks searched at growing offsets from their
recorded position, no fuzz. Pure functions; file I/O is the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch file that cannot be read, or a hunk that does not apply."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based, as in the @@ header
    new_start: int
    old: tuple[str, ...]  # lines the hunk expects (context + removed), without newlines
    new: tuple[str, ...]  # lines it leaves (context + added)


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


@dataclass(frozen=True)
class Patch:
    name: str
    subject: str
    message: str  # the commit message body (after the subject)
    files: tuple[FileDiff, ...] = field(default_factory=tuple)

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]


def _strip_prefix(p: str) -> str | None:
    if p == "/dev/null":
        return None
    return p[2:] if p[:2] in ("a/", "b/") else p


def parse_patch(text: str, name: str = "<patch>") -> Patch:
    """Parse one `git format-patch` file (mail header, message, then the diff)."""
    lines = text.splitlines()
    subject, body, i = "", [], 0
    # Mail header: Subject may be folded onto continuation lines.
    while i < len(lines) and lines[i] != "":
        if lines[i].startswith("Subject: "):
            subject = lines[i][len("Subject: ") :]
            while i + 1 < len(lines) and lines[i + 1].startswith(" "):
                i += 1
                subject += lines[i]
        i += 1
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    while i < len(lines) and not lines[i].startswith("diff --git ") and lines[i] != "---":
        body.append(lines[i])
        i += 1
    files: list[FileDiff] = []
    while i < len(lines):
        if not lines[i].startswith("diff --git "):
            i += 1
            continue
        i += 1
        old_path = new_path = None
        seen_header = False
        while i < len(lines) and not lines[i].startswith(("@@", "diff --git ")):
            if lines[i].startswith("--- "):
                old_path, seen_header = _strip_prefix(lines[i][4:].split("\t")[0]), True
            elif lines[i].startswith("+++ "):
                new_path = _strip_prefix(lines[i][4:].split("\t")[0])
            i += 1
        if not seen_header:
            raise PatchError(f"{name}: a diff without ---/+++ lines (binary or rename only)")
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise PatchError(f"{name}: malformed hunk header {lines[i]!r}")
            n_old = int(m.group(2)) if m.group(2) is not None else 1
            n_new = int(m.group(4)) if m.group(4) is not None else 1
            i += 1
            old: list[str] = []
            new: list[str] = []
            while len(old) < n_old or len(new) < n_new:
                if i >= len(lines):
                    raise PatchError(f"{name}: {new_path or old_path}: hunk is truncated")
                line = lines[i]
                tag, rest = (line[:1], line[1:]) if line else (" ", "")
                if tag == " ":
                    old.append(rest)
                    new.append(rest)
                elif tag == "-":
                    old.append(rest)
                elif tag == "+":
                    new.append(rest)
                elif tag != "\\":  # "\ No newline at end of file"
                    raise PatchError(f"{name}: unexpected line in hunk: {line!r}")
                i += 1
            while i < len(lines) and lines[i].startswith("\\"):
                i += 1
            hunks.append(Hunk(int(m.group(1)), int(m.group(3)), tuple(old), tuple(new)))
        files.append(FileDiff(old_path, new_path, tuple(hunks)))
    if not files:
        raise PatchError(f"{name}: no diff found")
    message = "\n".join(body).strip("\n")
    return Patch(name=name, subject=subject.strip(), message=message, files=tuple(files))


def read_patch(path: Path) -> Patch:
    try:
        return parse_patch(path.read_text(encoding="utf-8"), name=path.name)
    except OSError as e:
        raise PatchError(f"{path}: cannot read ({e.strerror})") from None


def _find(lines: list[str], block: tuple[str, ...], near: int, start: int) -> int | None:
    """Index of `block` in `lines` at or after `start`, closest to `near` (git apply's search)."""
    n = len(block)
    last = len(lines) - n
    if last < start:
        return None
    near = min(max(near, start), last)
    for delta in range(0, max(near - start, last - near) + 1):
        for pos in (near - delta, near + delta) if delta else (near,):
            if start <= pos <= last and tuple(lines[pos : pos + n]) == block:
                return pos
    return None


def apply_file(diff: FileDiff, text: str | None, reverse: bool = False) -> str | None:
    """Apply one file's hunks to `text` (None = the file does not exist).

    Returns the new text (None = the file is deleted). Raises PatchError naming the file and
    hunk when the context is not found."""
    source, target = (diff.new_path, diff.old_path) if reverse else (diff.old_path, diff.new_path)
    creates, deletes = source is None, target is None
    if creates:
        if text is not None:
            raise PatchError(f"{diff.path}: already exists")
        text = ""
    elif text is None:
        raise PatchError(f"{diff.path}: no such file")
    ends_with_nl = text.endswith("\n") or text == ""
    lines = text.splitlines()
    offset, cursor = 0, 0
    for k, h in enumerate(diff.hunks, 1):
        want, put = (h.new, h.old) if reverse else (h.old, h.new)
        at = h.new_start if reverse else h.old_start
        # A hunk with no old lines (-U0 insertion, or a new file) inserts after line `at`.
        pos = _find(lines, want, at - 1 + offset, cursor) if want else max(cursor, at + offset)
        if pos is None:
            raise PatchError(f"{diff.path}: hunk {k} (line {at}) does not apply")
        lines[pos : pos + len(want)] = list(put)
        offset += len(put) - len(want)
        cursor = pos + len(put)
    if deletes:
        if lines:
            raise PatchError(f"{diff.path}: file to delete still has content")
        return None
    out = "\n".join(lines)
    return out + "\n" if lines and ends_with_nl else out
