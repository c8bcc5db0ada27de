"""Every `VLLM_H20_*` environment variable: name, default, allowed values and what it does.

One table, like vLLM's `envs.py`, so `vllm-h20 env` and the README can list them and no module
parses a variable its own way. Stdlib only: the plugin reads these in every vLLM process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class SettingError(ValueError):
    """A `VLLM_H20_*` variable holds a value it cannot take (the message names it)."""


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    doc: str
    choices: tuple[str, ...] = ()  # empty: any string (a path)
    kind: str = "choice"  # choice | flag | path


_FLAG_VALUES = ("0", "1", "false", "true", "")

TABLE: tuple[Setting, ...] = (
    Setting(
        "VLLM_H20_MOE_DISPATCH", "per_expert",
        "per_expert: the fixed SM90 FP8 block-scale kernel choice; stock: FlashInfer's own "
        "(the A/B baseline).",
        ("per_expert", "stock"),
    ),
    Setting(
        "VLLM_H20_MOE_MODULE", "reduced",
        "reduced: block-scale MoE calls run on a module with only that path, built in minutes; "
        "full: FlashInfer's whole SM90 fused-MoE module from the patched sources (~40 min).",
        ("reduced", "full"),
    ),
    Setting(
        "VLLM_H20_STRICT", "0",
        "1: a fix module that cannot be had is an error instead of one warning and "
        "FlashInfer's own module.",
        kind="flag",
    ),
    Setting(
        "VLLM_H20_CACHE_DIR", "",
        "Where overlays, reduced modules, link shims and checks are kept (default "
        "$XDG_CACHE_HOME/vllm-h20, else ~/.cache/vllm-h20).",
        kind="path",
    ),
    Setting(
        "VLLM_H20_TEST_RELEASES", "installed",
        "Tests only: build the reduced fix module for the installed FlashInfer release "
        "(installed) or for every supported one (all, as .ci/run does).",
        ("installed", "all"),
    ),
    Setting(
        "VLLM_H20_REQUIRE_NVCC", "0",
        "1 (CI): a test that needs nvcc fails when it is missing instead of being skipped.",
        kind="flag",
    ),
    Setting(
        "VLLM_H20_STEP_TIMES", "",
        "A folder: every vLLM process that runs the model logs each engine step's GPU time "
        "there (steps-<pid>.jsonl, CUDA events around the forward), for serving A/Bs.",
        kind="path",
    ),
)  # fmt: skip
BY_NAME = {s.name: s for s in TABLE}


def raw(name: str, env: Mapping[str, str] | None = None) -> str:
    """The variable's value as set (stripped), else its default."""
    env = os.environ if env is None else env
    return env.get(name, BY_NAME[name].default).strip() or BY_NAME[name].default


def choice(name: str, env: Mapping[str, str] | None = None) -> str:
    s = BY_NAME[name]
    value = raw(name, env)
    if s.choices and value not in s.choices:
        raise SettingError(f"{name}={value!r} is not one of {', '.join(s.choices)} ({s.doc})")
    return value


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    value = raw(name, env).lower()
    if value not in _FLAG_VALUES:
        raise SettingError(f"{name}={value!r} is not 0 or 1")
    return value in ("1", "true")


def path(name: str, env: Mapping[str, str] | None = None) -> Path | None:
    value = raw(name, env)
    return Path(value).expanduser() if value else None


def current(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every setting's value as this process sees it ("(default)" marks an unset one)."""
    env = os.environ if env is None else env
    return {s.name: env.get(s.name, f"{s.default or '(empty)'} (default)") for s in TABLE}
