"""Where the files users read and edit (conversion rules, upstream patches) are at run time.

In a source checkout they are top-level folders (`conversion/`, `patches/`); a wheel maps them
into the package (`vllm_h20/rules`, `vllm_h20/patches`, see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def resolve_shipped(spec: str | Path, folder: Path) -> Path:
    """A path that exists, or the name of a file shipped in `folder` as NAME.yaml.

    Raises LookupError whose message lists the shipped names, for the caller's own error."""
    p = Path(spec)
    if p.exists():
        return p
    named = folder / f"{spec}.yaml"
    if named.exists():
        return named
    raise LookupError(", ".join(sorted(f.stem for f in folder.glob("*.yaml"))))


def shipped_dir(installed_name: str, checkout_name: str) -> Path:
    for cand in (_PACKAGE / installed_name, _PACKAGE.parent / checkout_name):
        if cand.is_dir():
            return cand
    return _PACKAGE.parent / checkout_name
