"""Where FlashInfer's C++/CUDA sources are, found without importing FlashInfer.

The plugin runs in vLLM's API server too, where importing FlashInfer would pull in torch;
`importlib.util.find_spec` on the top-level package only locates it. The layout mirrors
`flashinfer/jit/env.py`: a wheel ships its sources under `flashinfer/data/csrc`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DIST = "flashinfer-python"


class FlashInferNotFound(LookupError):
    pass


@dataclass(frozen=True)
class FlashInferSource:
    version: str
    package_dir: Path  # .../flashinfer

    @property
    def data_dir(self) -> Path:
        return self.package_dir / "data"

    @property
    def csrc_dir(self) -> Path:
        return self.data_dir / "csrc"

    @property
    def root(self) -> Path:
        """Where repository-relative patch paths (`csrc/...`) start: `csrc` maps to csrc_dir."""
        return self.data_dir

    def check(self) -> None:
        if not self.csrc_dir.is_dir():
            raise FlashInferNotFound(
                f"FlashInfer {self.version} at {self.package_dir} has no sources at "
                f"{self.csrc_dir}; install the flashinfer-python wheel (not a stripped build)"
            )


def installed() -> FlashInferSource:
    """The FlashInfer this interpreter would import."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise FlashInferNotFound("FlashInfer is not installed (pip install flashinfer-python)")
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    return from_package_dir(package_dir)


def from_package_dir(package_dir: Path) -> FlashInferSource:
    """A FlashInfer package directory (installed, or unpacked from a wheel)."""
    package_dir = Path(package_dir)
    if (package_dir / "flashinfer").is_dir() and not (package_dir / "data").is_dir():
        package_dir = package_dir / "flashinfer"  # given the unpacked wheel's root
    version = _version_near(package_dir)
    src = FlashInferSource(version=version, package_dir=package_dir)
    src.check()
    return src


def _version_near(package_dir: Path) -> str:
    """The version of the distribution that owns package_dir (its .dist-info sibling)."""
    for info in sorted(package_dir.parent.glob("flashinfer_python-*.dist-info")):
        meta = info / "METADATA"
        if meta.is_file():
            for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("Version: "):
                    return line.split(": ", 1)[1].strip()
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        pass
    vfile = package_dir / "_build_meta.py"
    if vfile.is_file():
        for line in vfile.read_text(encoding="utf-8").splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("\"'")
    return "unknown"
