"""Conversion rules: which source tensor becomes what, loaded from ``conversion/*.yaml``.

Rules are data so a new release layout is a YAML edit, not a code change; this module
only parses them strictly (an unknown key is an error, not a silent no-op) and matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .._data import shipped_dir

OPS = ("mxfp4_to_fp8", "fp8_reblock", "keep")
#: Input dtypes each converting op accepts for the weight and for its scale.
OP_DTYPES = {
    "mxfp4_to_fp8": ({"I8", "U8"}, {"F8_E8M0", "U8"}),
    "fp8_reblock": ({"F8_E4M3"}, {"F8_E8M0", "U8"}),
}
DEFAULT_RULES = "deepseek_v41_flash"


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class Rule:
    name: str
    op: str
    patterns: tuple[re.Pattern, ...]
    dtypes: frozenset[str] | None = None
    scale: str | None = None  # suffix replacing ".weight" to name the scale tensor

    def matches(self, name: str, dtype: str) -> bool:
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        return any(p.search(name) for p in self.patterns)

    def scale_name(self, weight_name: str) -> str | None:
        if self.scale is None or not weight_name.endswith(".weight"):
            return None
        return weight_name[: -len(".weight")] + self.scale


@dataclass(frozen=True)
class ConfigRewrite:
    model_types: tuple[str, ...]
    quantization_config: dict
    carry_over: tuple[str, ...] = ()
    expert_dtype: str | None = None


@dataclass(frozen=True)
class RuleSet:
    name: str
    path: Path
    rules: tuple[Rule, ...]
    config: ConfigRewrite
    description: str = ""
    digest: str = field(default="", compare=False)

    def first_match(self, name: str, dtype: str) -> Rule | None:
        return next((r for r in self.rules if r.matches(name, dtype)), None)


def _rules_dir() -> Path:
    """The shipped rule files: the repository's ``conversion/`` (also installed as package
    data ``vllm_h20/rules``)."""
    return shipped_dir("rules", "conversion")


def resolve(spec: str | Path | None) -> Path:
    """A rules file path, or the name of a shipped rule set (``deepseek_v41_flash``)."""
    spec = spec or DEFAULT_RULES
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return _rules_dir() / f"{spec}.yaml"


def _keys(where: str, d: dict, allowed: set[str], required: set[str]) -> None:
    if not isinstance(d, dict):
        raise RulesError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise RulesError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(d))
    if missing:
        raise RulesError(f"{where}: missing key(s) {missing}")


def load(spec: str | Path | None = None) -> RuleSet:
    import hashlib

    path = resolve(spec)
    try:
        text = path.read_text()
    except OSError as e:
        raise RulesError(f"{path}: cannot read rules file ({e.strerror})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RulesError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    _keys(str(path), doc, {"name", "description", "config", "rules"}, {"name", "config", "rules"})
    c = doc["config"]
    _keys(
        f"{path}: config",
        c,
        {"model_types", "quantization_config", "carry_over", "expert_dtype"},
        {"model_types", "quantization_config"},
    )
    cfg = ConfigRewrite(
        tuple(c["model_types"]),
        dict(c["quantization_config"]),
        tuple(c.get("carry_over") or ()),
        c.get("expert_dtype"),
    )
    if not isinstance(doc["rules"], list) or not doc["rules"]:
        raise RulesError(f"{path}: rules must be a non-empty list")
    rules = []
    for i, r in enumerate(doc["rules"]):
        where = f"{path}: rules[{i}]"
        _keys(where, r, {"name", "op", "match", "dtypes", "scale"}, {"name", "op", "match"})
        if r["op"] not in OPS:
            raise RulesError(f"{where} ({r['name']}): op {r['op']!r} is not one of {list(OPS)}")
        if r["op"] != "keep" and not r.get("scale"):
            raise RulesError(f"{where} ({r['name']}): op {r['op']} needs a `scale` suffix")
        pats = r["match"] if isinstance(r["match"], list) else [r["match"]]
        try:
            compiled = tuple(re.compile(p) for p in pats)
        except re.error as e:
            raise RulesError(f"{where} ({r['name']}): bad regex ({e})") from None
        dtypes = frozenset(r["dtypes"]) if r.get("dtypes") else None
        rules.append(Rule(r["name"], r["op"], compiled, dtypes, r.get("scale")))
    return RuleSet(
        doc["name"],
        path,
        tuple(rules),
        cfg,
        doc.get("description", ""),
        hashlib.sha256(text.encode()).hexdigest(),
    )
