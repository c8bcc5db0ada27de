"""`patches check --compile`: build and link the reduced fix module of a FlashInfer release in
a child interpreter that imports that release, then prove from ninja's dependency records that
every source including a patched file compiled the overlay's copy (not the stock one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from . import build, dispatch
from .overlay import overlay_for
from .plan import BuildPlan


def compile_touched(src, ps, import_root: Path | None, workdir: Path, jobs: int | None,
                    quiet: bool) -> dict:  # fmt: skip
    """Build and link the reduced fix module of this FlashInfer (`kernels build` in a child
    interpreter that imports it), then check from ninja's records that every source including a
    patched file compiled the overlay's copy."""
    ov = overlay_for(src, ps, workdir / "overlay")
    tag = f"{src.version}-{ov.key[:8]}"
    env = build.jit_env(workspace=workdir / "jit" / tag, arch="9.0a", cache=workdir / "overlay")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(import_root or ""), str(Path(__file__).resolve().parents[2]),
                    env.get("PYTHONPATH", "")) if p
    )  # fmt: skip
    for var in (dispatch.ENV, dispatch.MODULE_ENV, dispatch.STRICT_ENV):
        env.pop(var, None)
    jobs = jobs or os.cpu_count() or 1
    cmd = [sys.executable, "-m", "vllm_h20.cli", "kernels", "build", "--dispatch", "per_expert",
           "--module", "reduced", "--variant", "generic", "-j", str(jobs), "--json",
           "--log", str(workdir / "jit" / tag / "ninja.log")]  # fmt: skip
    (workdir / "jit" / tag).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True
    )
    try:
        built = json.loads(proc.stdout)[0]
    except (ValueError, IndexError):
        why = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"ok": False, "problems": [f"kernels build: {why[0]}"], "objects": []}
    plan = BuildPlan(**built["plan"])
    problems = list(built.get("link_problems", []))
    if proc.returncode != 0 and not problems:
        problems.append(f"kernels build exited {proc.returncode}")
    if not problems:
        # ninja occasionally records no dependencies for an object (seen once with two nvcc
        # jobs in parallel); rebuild such an object alone so the header check has its list.
        for source in plan.touched:
            obj = plan.objects[source]
            if not build.headers_used(plan, obj):
                Path(obj).unlink(missing_ok=True)
                try:
                    build.run_ninja(plan, [obj], 1, env)
                except build.BuildError as e:
                    problems.append(str(e))
        problems += build.wrong_headers(plan, ov, src.csrc_dir.resolve())
    seconds = build.build_seconds(plan)
    objects = [
        {
            "source": _csrc_relative(source),
            "object": obj,
            "built": Path(obj).is_file(),
            "seconds": seconds.get(os.path.normpath(obj)),
            "patched": source in plan.touched,
        }
        for source, obj in plan.objects.items()
    ]
    return {
        "ok": not problems,
        "module": plan.module,
        "library": plan.library,
        "build_seconds": built.get("seconds"),
        "objects": objects,
        "problems": problems,
    }


def _csrc_relative(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[parts.index("csrc") :]) if "csrc" in parts else path
