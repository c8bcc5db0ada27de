"""vllm_h20/settings.py: one table of every VLLM_H20_* variable, and the code reads only those."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_h20 import settings

ROOT = Path(__file__).resolve().parents[1]


def test_every_variable_the_package_reads_is_in_the_table():
    used = set()
    for f in (ROOT / "vllm_h20").rglob("*.py"):
        used |= set(re.findall(r"\bVLLM_H20_[A-Z_]+\b", f.read_text()))
    assert used <= set(settings.BY_NAME), sorted(used - set(settings.BY_NAME))
    assert all(s.doc and s.name.startswith("VLLM_H20_") for s in settings.TABLE)


def test_values_are_validated_with_the_variable_named():
    env = {"VLLM_H20_MOE_DISPATCH": " stock ", "VLLM_H20_STRICT": "true"}
    assert settings.choice("VLLM_H20_MOE_DISPATCH", env) == "stock"
    assert settings.choice("VLLM_H20_MOE_MODULE", env) == "reduced"  # the default
    assert settings.flag("VLLM_H20_STRICT", env) is True
    assert settings.flag("VLLM_H20_STRICT", {"VLLM_H20_STRICT": ""}) is False
    with pytest.raises(settings.SettingError, match=r"VLLM_H20_MOE_MODULE='tiny' is not one of"):
        settings.choice("VLLM_H20_MOE_MODULE", {"VLLM_H20_MOE_MODULE": "tiny"})
    with pytest.raises(settings.SettingError, match=r"VLLM_H20_STRICT='yes' is not 0 or 1"):
        settings.flag("VLLM_H20_STRICT", {"VLLM_H20_STRICT": "yes"})
    assert settings.path("VLLM_H20_CACHE_DIR", {}) is None
    assert settings.path("VLLM_H20_CACHE_DIR", {"VLLM_H20_CACHE_DIR": "~/x"}) == Path.home() / "x"


def test_current_marks_what_is_unset():
    cur = settings.current({"VLLM_H20_MOE_DISPATCH": "stock"})
    assert cur["VLLM_H20_MOE_DISPATCH"] == "stock"
    assert cur["VLLM_H20_MOE_MODULE"] == "reduced (default)"
    assert set(cur) == set(settings.BY_NAME)


def test_the_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    missing = [s.name for s in settings.TABLE if s.name not in readme]
    assert not missing, missing
