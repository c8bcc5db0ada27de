"""Fixtures the benchmark scripts' tests share with the package's: the installed FlashInfer's
sources (the patch maths' mirror in benchmarks/moe_dispatch/expected_m.py is checked against the
patched C++ built from them)."""

from tests.moe.conftest import installed_fi  # noqa: F401
