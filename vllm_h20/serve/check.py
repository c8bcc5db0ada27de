"""`vllm-h20 recipe check`: a recipe is what the installed vLLM accepts, with no conflicts.

vLLM's own parser and config classes do the validation (vllm_parse.py, in a child process);
on top we refuse combinations vLLM accepts silently but that cannot be what was meant.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io import write_json_atomic
from ..moe.paths import recipe_check_dir
from . import vllm_parse
from .recipe import Recipe, RecipeError


@dataclass(frozen=True)
class CheckResult:
    vllm: str
    flags: int
    parsed: dict[str, Any]


# Flags that differ from node to node of one deployment: `vllm-h20 serve --node-rank` adds them
# to each node's command, so one recipe serves every node.
NODE_FLAGS = ("headless", "data-parallel-size-local", "data-parallel-start-rank",
              "data-parallel-address", "data-parallel-rpc-port", "data-parallel-rank",
              "node-rank", "nnodes")  # fmt: skip
# All-to-all backends that hand the experts batched activations (one block per expert):
# FlashInfer's CUTLASS MoE takes the standard layout (vLLM 0.33: use_batched_activation_format).
BATCHED_ALL2ALL = ("deepep_low_latency", "nixl_ep")
# ... and, from vLLM 0.34, padded ones (`FusedMoEConfig.activation_format` is PaddedStandard for
# deepep_v2; FlashInfer CUTLASS declares Standard, and vLLM's MoE oracle refuses it at start-up).
PADDED_ALL2ALL = {"deepep_v2": (0, 34)}


def conflicts(r: Recipe) -> None:
    """Raise RecipeError for what vLLM would accept but not do as written."""
    if "config" in r.flags:
        raise RecipeError(
            f"{r.where('config')}: config: a recipe cannot include another config file "
            "(vLLM reads only one --config)"
        )
    for key in NODE_FLAGS:
        if r.get(key) is not None:
            raise RecipeError(
                f"{r.where(key)}: {key}: differs per node; leave it out of the recipe "
                "(`vllm-h20 serve --node-rank N --data-parallel-address HOST` adds it per node)"
            )
    a2a = r.get("all2all-backend")
    if a2a is not None and not r.get("enable-expert-parallel", False):
        raise RecipeError(
            f"{r.where('all2all-backend')}: all2all-backend: {a2a} has no effect without "
            "enable-expert-parallel: true"
        )
    if a2a in BATCHED_ALL2ALL and r.get("moe-backend") == "flashinfer_cutlass":
        raise RecipeError(
            f"{r.where('all2all-backend')}: all2all-backend: {a2a} hands the experts batched "
            "activations, which moe-backend flashinfer_cutlass does not take; use "
            "allgather_reducescatter or deepep_high_throughput"
        )
    eplb = bool(r.get("enable-eplb", False))
    ep = bool(r.get("enable-expert-parallel", False))
    redundant = r.get("eplb-config.num_redundant_experts", 0) or 0
    if eplb and not ep:
        raise RecipeError(
            f"{r.where('enable-eplb')}: enable-eplb needs enable-expert-parallel: true "
            "(EPLB balances experts across expert-parallel ranks)"
        )
    if redundant and not eplb:
        raise RecipeError(
            f"{r.where('eplb-config')}: eplb-config.num_redundant_experts: {redundant} has no "
            "effect without enable-eplb: true"
        )


def check_argv(extra: list[str]) -> None:
    """Extra `vllm serve` arguments: `--config=FILE` is silently ignored by vLLM, and the
    per-node flags are `vllm-h20 serve`'s to set."""
    for a in extra:
        name = a.split("=", 1)[0]
        if name.startswith("--") and name[2:] in NODE_FLAGS:
            raise RecipeError(
                f"{name}: vllm-h20 serve sets it per node (--node-rank, "
                "--data-parallel-address, --data-parallel-rpc-port)"
            )
        if a.startswith("--config="):
            raise RecipeError(
                f"{a}: vLLM ignores --config=FILE; pass the recipe as FILE (or --config FILE)"
            )
        if a == "--config":
            raise RecipeError("--config: the recipe is already the config file; give one only")


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def version_conflicts(r: Recipe, vllm: str) -> None:
    """What the vLLM that parsed the recipe would refuse only at start-up, minutes in."""
    a2a = r.get("all2all-backend")
    since = PADDED_ALL2ALL.get(a2a)
    if since and _release(vllm) >= since and r.get("moe-backend") == "flashinfer_cutlass":
        raise RecipeError(
            f"{r.where('all2all-backend')}: all2all-backend: {a2a} hands the experts padded "
            f"activations in vLLM {vllm}, which moe-backend flashinfer_cutlass does not take "
            "(vLLM stops at start-up); use allgather_reducescatter or deepep_high_throughput"
        )


def check(r: Recipe, python: str | None = None) -> CheckResult:
    conflicts(r)
    out = _parse(r, python)
    if not out["ok"]:
        key = out.get("key")
        where = r.where(key) if key else str(r.path)
        raise RecipeError(f"{where}: {key + ': ' if key else ''}{out['error']}")
    version_conflicts(r, out["vllm"])
    return CheckResult(vllm=out["vllm"], flags=out["flags"], parsed=out["parsed"])


def _parse(r: Recipe, python: str | None) -> dict[str, Any]:
    """What vLLM's parser makes of the recipe (vllm_parse.py in a child process: importing vLLM
    takes 10-30 s). An accepted recipe's answer is kept under the cache root, keyed by the
    recipe's bytes, the installed vLLM and the parser script, so `plan` and `serve` on the same
    recipe do not pay for it again; another interpreter (`python`) is always asked."""
    cached = _cache_file(r) if python is None else None
    if cached is not None and cached.is_file():
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):
            pass  # a damaged entry: ask vLLM again
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CONFIGURE_LOGGING="0")
    proc = subprocess.run(
        [python or sys.executable, "-m", "vllm_h20.serve.vllm_parse", str(r.path)],
        capture_output=True,
        text=True,
        env=env,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM_PARSE ")), None)
    if line is None:
        if "No module named 'vllm'" in proc.stderr:
            raise RecipeError(
                "vLLM is not installed here; install it (README's set-up command 2) to check"
            )
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RecipeError(f"{r.path}: vLLM's parser failed: {tail}")
    out = json.loads(line[len("VLLM_PARSE ") :])
    if out["ok"] and cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cached, out)
        except OSError:
            pass  # a read-only or full cache only costs the next check its time
    return out


def _cache_file(r: Recipe) -> Path | None:
    try:
        vllm = importlib.metadata.version("vllm")
        key = hashlib.sha256(
            Path(r.path).read_bytes()
            + Path(vllm_parse.__file__).read_bytes()
            + f"\0{vllm}\0{sys.executable}".encode()
        ).hexdigest()
    except (importlib.metadata.PackageNotFoundError, OSError):
        return None
    return recipe_check_dir() / f"{key[:32]}.json"
