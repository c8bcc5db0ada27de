"""The wheel ships every subpackage and the conversion rules (pyproject lists packages
explicitly because conversion/ is mapped into vllm_h20.rules)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # stdlib from Python 3.11

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vllm_h20").rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)
    assert cfg["package-dir"]["vllm_h20.rules"] == "conversion"
    assert (ROOT / "conversion" / "deepseek_v41_flash.yaml").is_file()


def test_console_script_points_at_the_cli():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert proj["scripts"]["vllm-h20"] == "vllm_h20.cli:main"
