"""The GuideLLM patch in patches/guidellm/ (for main) and its backport for the release the
sweeps run (patches/guidellm/v0.8.1/).

The patch for main carries GuideLLM's own test, which runs in GuideLLM's tree. Here the backport
is applied to the installed release's `backends/openai/http.py`, and its line reader runs on a
real httpx stream: the released reader cuts a completion event at U+2028, the patched one
does not."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

guidellm = pytest.importorskip("guidellm")

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches" / "guidellm"
[PATCH] = sorted(PATCHES.glob("*.patch"))  # for main, with its test
[BACKPORT] = sorted((PATCHES / f"v{version('guidellm')}").glob("*.patch"))  # the release
SOURCE = "src/guidellm/backends/openai/http.py"
EVENT = 'data: {"choices": [{"index": 0, "text": "a\u2028b\u0085c\u2029d"}]}'


class _Chunks(httpx.AsyncByteStream):
    """The response body in the chunks given, as a server's writes arrive."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for c in self.chunks:
            yield c


def _lines(aiter_lines) -> list[str]:
    """What a backend's `_aiter_lines` yields for one streamed completion event and [DONE], cut
    inside the UTF-8 bytes of U+2028."""
    body = f"{EVENT}\r\n\r\ndata: [DONE]\n\n".encode()
    cut = body.index("\u2028".encode()) + 1

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunks([body[:cut], body[cut:]]))

    async def read() -> list[str]:
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client,
            client.stream("POST", "http://server/v1/completions") as resp,
        ):
            return [line async for line in aiter_lines(None, resp)]

    return asyncio.run(read())


def _patched_release(tmp_path: Path) -> Path:
    """A copy of the installed release with the backport applied (`git apply`, as a user of the
    release would): the folder to put first on PYTHONPATH."""
    src = tmp_path / "src"
    shutil.copytree(Path(guidellm.__file__).parent, src / "guidellm",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    res = subprocess.run(["git", "apply", str(BACKPORT)], cwd=tmp_path, capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return src


def test_released_guidellm_cuts_an_event_at_a_unicode_line_separator():
    """The defect the patch fixes, on the installed release: the sweeps' `errored` requests
    with `JSONDecodeError: Unterminated string` (serving rounds 6-7)."""
    from guidellm.backends.openai.http import OpenAIHTTPBackend

    lines = _lines(OpenAIHTTPBackend._aiter_lines)
    assert lines[0] == 'data: {"choices": [{"index": 0, "text": "a'
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        json.loads(lines[0].removeprefix("data: "))


def test_backport_applies_to_the_release_and_keeps_each_event_whole(tmp_path):
    """The patched release, imported in a fresh interpreter (GuideLLM registers its backends by
    name, once per process), reads the same stream as one event and [DONE]."""
    src = _patched_release(tmp_path)
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_guidellm_patch import _lines\n"
        "from guidellm.backends.openai.http import OpenAIHTTPBackend\n"
        "print(json.dumps(_lines(OpenAIHTTPBackend._aiter_lines)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(src)}, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = json.loads(res.stdout.splitlines()[-1])
    assert lines == [EVENT, "data: [DONE]"]
    event = json.loads(lines[0].removeprefix("data: "))
    assert event["choices"][0]["text"] == "a\u2028b\u0085c\u2029d"


def test_patches_are_git_am_commits_and_make_the_same_change():
    """Each is one `git am` commit; the one for main also adds GuideLLM's test; both make the
    same change to the line reader (only their context lines differ)."""

    def parse(patch: Path) -> tuple[list[str], list[str]]:
        text = patch.read_text()
        assert text.startswith("From ") and "\nSubject: [PATCH] " in text
        lines = text.splitlines()
        files = [ln.split(" b/")[-1] for ln in lines if ln.startswith("diff --git ")]
        # the http.py diff (the first file), without format-patch's signature
        source = text.split("diff --git ")[1].split("\n-- \n")[0]
        changed = [
            ln for ln in source.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
        ]
        return files, changed

    files, change = parse(PATCH)
    assert files == [SOURCE, "tests/unit/backends/openai/test_http.py"]
    backport_files, backport_change = parse(BACKPORT)
    assert backport_files == [SOURCE]
    assert backport_change == change
