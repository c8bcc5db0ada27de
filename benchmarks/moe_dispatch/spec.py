"""The A/B's spec (spec.yaml): families, routings, token counts and the versions compared.

Read once by run.py and written into its JSON, so a run names what it measured and the
report needs no table of its own. Every key is checked: a misspelt one is refused in one
line naming the file and the key, never ignored on a lease.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import cases
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT = HERE / "spec.yaml"
EXPECTED_M = ("tokens", "average")


class SpecError(ValueError):
    """A spec that cannot be run: the message names the file and the key."""


@dataclass(frozen=True)
class Version:
    """One column: FlashInfer's sources with `patches` applied in order (repository paths),
    its runner told `expected_m` ("tokens": stock's bug, "average": rows per slot). calib: the
    build also gets calib.patch (the emulations' switches); single: one launch chosen from
    expected_m (FlashInfer's own rule), a calib build's switch. same_as: a second copy of
    another version (A/A)."""

    name: str
    label: str
    patches: tuple[str, ...] = ()
    expected_m: str = "average"
    same_as: str = ""
    calib: bool = False
    single: bool = False


@dataclass(frozen=True)
class Spec:
    families: tuple[cases.Family, ...]
    versions: tuple[Version, ...]
    routings: tuple[str, ...]
    tokens: tuple[int, ...]
    lead: str
    also_beat: str
    source: str = ""

    def family(self, name: str) -> cases.Family:
        return next(f for f in self.families if f.name == name)

    def to_json(self) -> dict:
        return {"source": self.source, "lead": self.lead, "also_beat": self.also_beat,
                "routings": list(self.routings), "tokens": list(self.tokens),
                "families": [asdict(f) | {"local": f.local} for f in self.families],
                "versions": [asdict(v) for v in self.versions]}  # fmt: skip


def _keys(where: str, table: dict, required: set[str], optional: set[str]) -> None:
    unknown = sorted(set(table) - required - optional)
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)} "
                        f"(known: {', '.join(sorted(required | optional))})")  # fmt: skip
    missing = sorted(required - set(table))
    if missing:
        raise SpecError(f"{where}: missing key(s) {', '.join(missing)}")


def parse(doc, source: str = "spec.yaml") -> Spec:
    """A Spec from a parsed spec.yaml; SpecError naming the key when one is wrong."""
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: not a mapping of lead, also_beat, tokens, routings, "
                        "families, versions")  # fmt: skip
    _keys(source, doc, {"families", "versions", "routings", "tokens", "lead", "also_beat"}, set())
    fams = []
    for i, f in enumerate(doc["families"]):
        where = f"{source}: family {f.get('name', i + 1)!r}"
        _keys(where, f, {"name", "experts", "slots", "top_k", "ep", "hidden", "inter"}, {"label"})
        try:
            fams.append(cases.Family(**f))
        except (TypeError, ValueError) as e:
            raise SpecError(f"{where}: {e}") from None
    versions = []
    for i, v in enumerate(doc["versions"]):
        where = f"{source}: version {v.get('name', i + 1)!r}"
        _keys(where, v, {"name", "label"}, {"patches", "expected_m", "same_as", "calib", "single"})
        if v.get("single") and not v.get("calib"):
            raise SpecError(f"{where}: single is a switch of the calibration build: set calib")
        if v.get("expected_m", "average") not in EXPECTED_M:
            raise SpecError(f"{where}: expected_m must be one of {', '.join(EXPECTED_M)}")
        for p in v.get("patches", ()):
            if not (REPO / p).is_file():
                raise SpecError(f"{where}: patch {p} does not exist (paths from the repository "
                                "root)")  # fmt: skip
        versions.append(Version(**(v | {"patches": tuple(v.get("patches", ()))})))
    names = [v.name for v in versions]
    if len(set(names)) != len(names) or len({f.name for f in fams}) != len(fams):
        raise SpecError(f"{source}: version and family names must be unique")
    for v in versions:
        if v.same_as and (v.same_as not in names or v.patches):
            raise SpecError(f"{source}: version {v.name!r}: same_as names another version "
                            "and takes no patches of its own")  # fmt: skip
    versions = [Version(v.name, v.label, by.patches, by.expected_m, v.same_as, by.calib,
                        by.single) if v.same_as and (by := versions[names.index(v.same_as)])
                else v for v in versions]  # fmt: skip
    for key in ("lead", "also_beat"):
        if doc[key] not in names:
            raise SpecError(f"{source}: {key} = {doc[key]!r} is not a version")
    unknown = sorted(set(doc["routings"]) - set(cases.ALL_ROUTINGS))
    if unknown:
        raise SpecError(f"{source}: routings: unknown {', '.join(unknown)} "
                        f"(one of {', '.join(cases.ALL_ROUTINGS)})")  # fmt: skip
    if not doc["tokens"] or any(not isinstance(t, int) or t < 1 for t in doc["tokens"]):
        raise SpecError(f"{source}: tokens: a list of positive integers")
    return Spec(tuple(fams), tuple(versions), tuple(doc["routings"]), tuple(doc["tokens"]),
                doc["lead"], doc["also_beat"], source)  # fmt: skip


def load(path: Path = DEFAULT) -> Spec:
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not YAML: {str(e).splitlines()[0]}") from None
    return parse(doc, str(path))


def select(spec: Spec, families: str = "", routings: str = "", tokens: str = "") -> Spec:
    """The spec narrowed to comma-separated families, routings and token counts (each
    refused in one line when it is not in the spec)."""

    def pick(what: str, arg: str, have: tuple, conv=str) -> tuple:
        if not arg:
            return have
        try:
            want = tuple(conv(x) for x in arg.split(",") if x)
        except ValueError:
            raise SpecError(f"--{what}: {arg!r} is not a comma-separated list") from None
        if what == "tokens":
            return want  # any positive count: the runs beyond the spec's list are the user's
        unknown = [w for w in want if w not in have]
        if unknown:
            raise SpecError(f"--{what}: {', '.join(map(str, unknown))} not in {spec.source} "
                            f"(there: {', '.join(map(str, have))})")  # fmt: skip
        return want

    names = pick("families", families, tuple(f.name for f in spec.families))
    return Spec(tuple(spec.family(n) for n in names), spec.versions,
                pick("routings", routings, spec.routings),
                pick("tokens", tokens, spec.tokens, int), spec.lead, spec.also_beat,
                spec.source)  # fmt: skip
