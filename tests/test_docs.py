"""Every relative link in the repository's Markdown files points at a file that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and [text](<target>); images too. Code spans are dropped first.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def markdown_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    text = _CODE.sub("", md.read_text(encoding="utf-8"))
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same file
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (md.parent / path).exists():
            bad.append(f"{md.relative_to(root)}: {target}")
    return bad


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "b.md").write_text("x")
    (tmp_path / "d").mkdir()
    md = tmp_path / "a.md"
    md.write_text(
        "[ok](b.md) [ok](b.md#x) [dir](d/) [web](https://x.y/z) [here](#top) ![gone](c.png)\n"
        "`[code](e.md)`\n```\n[block](f.md)\n```\n[also gone](<d/g.md>)\n"
    )
    assert broken_links(md, tmp_path) == ["a.md: c.png", "a.md: d/g.md"]


def test_no_broken_link_in_any_markdown_file():
    files = markdown_files()
    assert len(files) > 10
    bad = [b for md in files for b in broken_links(md)]
    assert not bad, "\n".join(bad)
