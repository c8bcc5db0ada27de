"""The vLLM plugin: discovered by vLLM, cheap to load, and switching FlashInfer's SM90 MoE build."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_h20.moe import dispatch, hook
from vllm_h20.moe.overlay import FixState


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_H20_", "VLLM_PLUGINS"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_entry_point_is_registered_for_vllm():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [e for e in eps if e.name == "vllm_h20"]
    assert [e.value for e in ours] == ["vllm_h20.plugin:register"]
    from vllm_h20.plugin import register

    assert ours[0].load() is register


def test_plugin_load_imports_nothing_heavy_and_logs_one_line(tmp_path):
    r = _run(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(message)s")
        from vllm_h20.plugin import register
        register(); register()
        heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "flashinfer", "numpy",
                       "vllm", "rich", "click", "yaml", "ml_dtypes"})
        print("HEAVY", heavy)
        """,
        VLLM_H20_CACHE_DIR=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("vllm.plugins.vllm_h20|")]
    assert len(lines) == 1, r.stderr
    assert "vllm-h20: MoE dispatch" in lines[0]


def test_hook_runs_after_import_and_for_already_imported_modules(tmp_path, monkeypatch):
    pkg = tmp_path / "hookpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("def gen():\n    return 'stock'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def patch_it(mod):
        seen.append(mod.__name__)
        mod.gen = lambda: "patched"

    hook.after_import("hookpkg.core", patch_it)
    assert seen == []  # nothing imported yet
    import hookpkg.core

    assert seen == ["hookpkg.core"] and hookpkg.core.gen() == "patched"
    hook.after_import("hookpkg.core", patch_it)  # already imported: called at once
    assert seen == ["hookpkg.core", "hookpkg.core"]
    assert not any(isinstance(f, hook._AfterImport) for f in sys.meta_path)


def test_dispatch_settings(installed_fi, patches):
    assert dispatch.requested_mode({}) == "per_expert"
    fix = dispatch.decide({}, src=installed_fi, patches=patches)
    assert fix.route == "fix" and not fix.overlay and fix.per_expert and not fix.warn
    assert "reduced fix module" in fix.message and "patch series flashinfer" in fix.message
    stock = dispatch.decide({dispatch.ENV: "stock"}, src=installed_fi, patches=patches)
    assert stock.route == "stock" and not stock.per_expert
    assert "VLLM_H20_MOE_DISPATCH=stock" in stock.message and "unpatched" in stock.message
    full = dispatch.decide({dispatch.MODULE_ENV: "full"}, src=installed_fi, patches=patches)
    assert full.overlay and full.route is None and full.per_expert
    assert full.assessment.state is FixState.NEEDS_PATCH
    none = dispatch.decide({dispatch.ENV: "stock", dispatch.MODULE_ENV: "full"})
    assert not none.overlay and none.route is None and "FlashInfer unchanged" in none.message
    assert dispatch.decide({dispatch.STRICT_ENV: "1"}, src=installed_fi, patches=patches).strict
    for env, says in [
        ({dispatch.ENV: "fast"}, "'fast' is not one of per_expert, stock"),
        ({dispatch.MODULE_ENV: "tiny"}, "'tiny' is not one of reduced, full"),
        ({dispatch.STRICT_ENV: "yes"}, "is not 0 or 1"),
    ]:
        with pytest.raises(dispatch.DispatchConfigError, match=says):
            dispatch.decide(env)


@pytest.mark.parametrize(
    "state, says, warn",
    [
        ("patched", "already contains the fix", False),
        ("fixed-upstream", "assuming FlashInfer fixed it itself", False),
        ("conflict", "STOCK (fix not applied)", True),
    ],
)
def test_no_fix_module_unless_the_sources_need_it(fake_fi, patches, state, says, warn):
    d = dispatch.decide({}, src=fake_fi(state), patches=patches)
    assert not d.overlay and d.route is None
    assert says in d.message and d.warn is warn


def test_a_conflict_is_an_error_when_strict(fake_fi, patches):
    with pytest.raises(dispatch.DispatchConfigError, match="VLLM_H20_STRICT=1"):
        dispatch.decide({dispatch.STRICT_ENV: "1"}, src=fake_fi("conflict"), patches=patches)


VLLM_RUN = """
    import json, logging, sys
    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.plugins import load_general_plugins
    configure_logging(LoggingConfig())  # vLLM's own logging set-up, as in `vllm serve`
    load_general_plugins()
    assert "flashinfer.fused_moe.core" not in sys.modules
    import flashinfer.fused_moe.core as core
    get, gen = core.get_cutlass_fused_moe_module, core.gen_cutlass_fused_moe_sm90_module
    out = {"router": getattr(get, "vllm_h20", False), "whole": getattr(gen, "vllm_h20", False)}
    if out["router"]:
        out["sm90"] = type(get("90")).__name__
    if out["whole"]:
        spec = gen()
        out.update(name=spec.name, first=str(spec.sources[0]))
    print("RESULT " + json.dumps(out))
"""


def _vllm_result(**env):
    r = _run(VLLM_RUN, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :]), r.stdout + r.stderr


@pytest.mark.vllm
def test_vllm_loads_the_plugin_and_flashinfer_routes_block_scale_calls(installed_fi, tmp_path):
    pytest.importorskip("vllm")
    env = dict(
        VLLM_H20_CACHE_DIR=str(tmp_path / "c"),
        FLASHINFER_WORKSPACE_BASE=str(tmp_path / "ws"),
        FLASHINFER_CUDA_ARCH_LIST="9.0a",
    )
    res, log = _vllm_result(**env)
    assert res == {"router": True, "whole": False, "sm90": "Sm90Routes"}, log
    assert log.count("vllm-h20: MoE dispatch: per-expert kernel choice") == 1
    assert "runs on the reduced fix module" in log

    res, log = _vllm_result(VLLM_H20_MOE_DISPATCH="stock", **env)
    assert res["router"] and not res["whole"] and "VLLM_H20_MOE_DISPATCH=stock" in log

    res, log = _vllm_result(VLLM_H20_MOE_MODULE="full", **env)
    assert res["whole"] and not res["router"], log
    assert res["name"].startswith("fused_moe_90") and "_vllm_h20_" in res["name"]
    assert res["first"].startswith(str(tmp_path / "c" / "flashinfer" / installed_fi.version))

    res, log = _vllm_result(VLLM_H20_MOE_DISPATCH="stock", VLLM_H20_MOE_MODULE="full", **env)
    assert res == {"router": False, "whole": False} and "FlashInfer unchanged" in log

    res, log = _vllm_result(VLLM_PLUGINS="some_other_plugin", **env)
    assert res == {"router": False, "whole": False} and "vllm-h20" not in log


def test_missing_patches_warn_and_keep_flashinfer_stock(installed_fi, monkeypatch, tmp_path):
    from vllm_h20.moe import overlay

    monkeypatch.setattr(overlay, "patches_dir", lambda: tmp_path / "nowhere")
    monkeypatch.setattr(dispatch, "shipped_patches", overlay.shipped_patches)
    d = dispatch.decide({}, src=installed_fi)
    assert not d.overlay and d.warn and "no flashinfer patches found" in d.message
