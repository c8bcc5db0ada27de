"""Shared fixtures: small generated checkpoints (built once per session, read-only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_h20.convert.synth import PRESETS, generate

# The vLLM releases the suite runs against: README's test command installs the last (CI's);
# the one before still passes locally (`pip install vllm==0.33.0`).
TESTED_VLLM = ("0.33.0", "0.34.0")


def installed_vllm() -> str | None:
    """The installed vLLM's version, without importing it (tests compare messages to it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory) -> Path:
    """A tiny V4.1-layout checkpoint with every tensor kind; tests must not modify it."""
    d = tmp_path_factory.mktemp("tiny") / "src"
    generate(d, PRESETS["tiny"], shards=3, spread=6, seed=1)
    return d


@pytest.fixture
def tiny_copy(tiny_src, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    d = tmp_path / "src"
    shutil.copytree(tiny_src, d)
    return d
