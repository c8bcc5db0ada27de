"""Our unified-diff applier must do what `git apply` does (exact context, offsets, no fuzz)."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_h20.moe.patchfile import PatchError, apply_file, parse_patch, read_patch

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "patches" / "flashinfer").glob("*.patch"))


def _git_patch(path: str, old: list[str], new: list[str], n: int = 3) -> str:
    body = "".join(
        difflib.unified_diff(
            [x + "\n" for x in old], [x + "\n" for x in new], f"a/{path}", f"b/{path}", n=n
        )
    )
    return (
        "From 0000 Mon Sep 17 00:00:00 2001\nFrom: t <t@t>\nSubject: [PATCH] edit it\n\n"
        f"Body line.\n---\ndiff --git a/{path} b/{path}\n{body}"
    )


def test_shipped_patch_parses_with_its_message_and_files():
    assert SHIPPED, "patches/flashinfer has no patch"
    p = read_patch(SHIPPED[0])
    assert p.subject.startswith("fused_moe: ")
    assert "Workspace sizing is untouched" in p.message
    assert any(f.startswith("csrc/") for f in p.paths)
    test = [f for f in p.files if f.path.startswith("tests/moe/")]
    assert test and test[0].old_path is None  # the FlashInfer-style test is a new file


lines = st.lists(st.sampled_from(["a", "b", "c", "d", "{", "}", "", "x = 1;"]), max_size=40)


@settings(max_examples=200, deadline=None)
@given(old=lines, new=lines, ctx=st.integers(0, 3))
def test_apply_then_reverse_round_trips(old, new, ctx):
    if old == new:
        return
    d = parse_patch(_git_patch("f.txt", old, new, n=ctx)).files[0]
    old_text = "".join(x + "\n" for x in old)
    new_text = "".join(x + "\n" for x in new)
    assert apply_file(d, old_text) == new_text
    assert apply_file(d, new_text, reverse=True) == old_text


def test_hunks_are_found_at_an_offset_but_never_fuzzed():
    old = [f"line {i}" for i in range(30)]
    new = old[:10] + ["inserted"] + old[10:]
    d = parse_patch(_git_patch("src/x.c", old, new)).files[0]
    shifted = "\n".join(["new top"] * 7 + old) + "\n"
    assert "inserted" in apply_file(d, shifted)
    changed = old[:]
    changed[9] = "line 9 edited"  # one context line differs: git apply refuses too
    with pytest.raises(PatchError, match=r"src/x.c: hunk 1 \(line \d+\) does not apply"):
        apply_file(d, "\n".join(changed) + "\n")


def test_new_and_deleted_files():
    text = (
        "Subject: [PATCH] add\n\n---\n"
        "diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n"
        "@@ -0,0 +1,2 @@\n+a\n+b\n"
    )
    d = parse_patch(text).files[0]
    assert apply_file(d, None) == "a\nb\n"
    assert apply_file(d, "a\nb\n", reverse=True) is None
    with pytest.raises(PatchError, match="n.py: already exists"):
        apply_file(d, "x\n")
    mod = parse_patch(_git_patch("m.txt", ["1", "2"], ["1", "3"])).files[0]
    with pytest.raises(PatchError, match="m.txt: no such file"):
        apply_file(mod, None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("Subject: x\n\nno diff here\n", "no diff found"),
        ("Subject: x\n\n---\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n@@ bad @@\n", "malformed"),
        (
            "Subject: x\n\n---\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n",
            "truncated",
        ),
    ],
)
def test_malformed_patches_name_the_problem(text, message):
    with pytest.raises(PatchError, match=message):
        parse_patch(text, name="bad.patch")
