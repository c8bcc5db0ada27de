"""A recipe: a `vllm serve --config` YAML file, read with the line of every key.

vLLM turns each top-level key into `--key value` (maps become JSON for its nested config
classes); we keep the lines so every error can name `file:line: key`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .._data import resolve_shipped, shipped_dir

# GPUs per node the recipes are laid out for (an HGX H20 node); `plan` and `serve` take another.
GPUS_PER_NODE = 8


class RecipeError(ValueError):
    """A recipe that vLLM would reject or misread; the message names file, line and key."""


@dataclass
class Recipe:
    path: Path
    flags: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str) -> str:
        line = self.lines.get(key.split(".")[0])
        return f"{self.path}:{line}" if line else str(self.path)

    def get(self, key: str, default: Any = None) -> Any:
        """`a.b` reads a nested field; dashes and underscores are the same in flag names."""
        head, _, rest = key.partition(".")
        value = self.flags.get(head, self.flags.get(head.replace("-", "_"), default))
        if rest:
            return value.get(rest, default) if isinstance(value, dict) else default
        return value


def shipped_recipes() -> Path:
    return shipped_dir("recipes", "recipes")


def resolve(spec: str | Path) -> Path:
    """A path, or the name of a shipped recipe (`deepseek-v41-flash-fp8-tp8ep8`)."""
    try:
        return resolve_shipped(spec, shipped_recipes())
    except LookupError as e:
        raise RecipeError(f"{spec}: no such recipe file or shipped recipe (shipped: {e})") from None


def load(spec: str | Path) -> Recipe:
    path = resolve(spec)
    if path.suffix not in (".yaml", ".yml"):
        raise RecipeError(f"{path}: vLLM reads only .yaml/.yml config files")
    try:
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text)
        flags = yaml.safe_load(text)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise RecipeError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(flags, dict) or node is None:
        raise RecipeError(f"{path}: a recipe is a mapping of `vllm serve` flags to values")
    lines = {k.value: k.start_mark.line + 1 for k, _v in node.value}
    return Recipe(path=path, flags=flags, lines=lines)
