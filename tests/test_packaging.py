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


def test_plugin_entry_point_and_patches_are_declared():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = proj["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"vllm_h20": "vllm_h20.plugin:register"}
    cfg = proj["tool"]["setuptools"]
    assert cfg["package-dir"]["vllm_h20.patches"] == "patches"
    assert "flashinfer/*.patch" in cfg["package-data"]["vllm_h20.patches"]
    assert cfg["package-dir"]["vllm_h20.recipes"] == "recipes"
    assert cfg["package-dir"]["vllm_h20.sweeps"] == "benchmarks/sweeps"


@pytest.mark.slow
def test_wheel_ships_rules_patches_and_the_plugin(tmp_path):
    import subprocess
    import sys
    import zipfile

    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build without isolation here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("vllm_h20-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    base = ROOT / "patches" / "flashinfer"
    shipped = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.patch"))
    assert any("/" in p for p in shipped)  # a release's own series (v0.6.14/) ships too
    prefix = "vllm_h20/patches/flashinfer/"
    assert sorted(n[len(prefix) :] for n in names if n.endswith(".patch")) == shipped
    assert not any("candidates" in n for n in names)  # the series that lost: git history only
    assert "vllm_h20/patches/flashinfer/reproduce_expected_m.py" in names  # `patches export`
    assert "vllm_h20/rules/deepseek_v41_flash.yaml" in names
    assert "vllm_h20/plugin.py" in names
    assert "vllm_h20/recipes/deepseek-v41-flash-fp8-tp8ep8.yaml" in names
    assert {"vllm_h20/sweeps/decode.yaml", "vllm_h20/sweeps/prefill.yaml"} <= set(names)
    assert "vllm_h20/bench/sweep.py" in names
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vllm_h20 = vllm_h20.plugin:register" in zipfile.ZipFile(wheel).read(ep).decode()
