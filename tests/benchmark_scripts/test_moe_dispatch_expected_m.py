import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

_m = load_script(ROOT / "benchmarks" / "moe_dispatch" / "expected_m.py", "moe_dispatch_expected_m")
DispatchCase, branch = _m.DispatchCase, _m.branch
per_expert_expected_m, swap_threshold = _m.per_expert_expected_m, _m.swap_threshold

tokens = st.integers(0, 1 << 20)
small = st.integers(1, 512)


@given(tokens, small, small, st.integers(1, 64))
def test_matches_the_exact_ceiling(t, k, e, ep):
    want = max(1, math.ceil(t * k / (e * ep))) if t else 1
    assert per_expert_expected_m(t, k, e, ep) == want
    # integer arithmetic: no float rounding even for huge products
    assert per_expert_expected_m(t, k, e, ep) * e * ep >= t * k


@given(tokens, tokens, small, small, st.integers(1, 64))
def test_monotone_in_tokens_and_never_above_stock_rows(a, b, k, e, ep):
    lo, hi = sorted((a, b))
    assert per_expert_expected_m(lo, k, e, ep) <= per_expert_expected_m(hi, k, e, ep)
    assert per_expert_expected_m(hi, k, e, ep) <= max(1, hi * k)


def test_seed_example_v41_flash_ep8_with_eplb():
    # 288 tokens, top-6, 384 experts + 16 EPLB replicas = 400 slots = 50 per rank x EP8
    case = DispatchCase(tokens=288, top_k=6, local_experts=50, ep_size=8, num_sms=78)
    assert case.fixed_m == 5 and case.stock_m == 288
    assert (case.stock_branch, case.fixed_branch) == ("regular", "swap_ab")
    assert case.changes


@pytest.mark.parametrize("sms,threshold", [(78, 64), (132, 32), (114, 32)])
def test_threshold_per_device(sms, threshold):
    assert swap_threshold(sms) == threshold
    assert branch(threshold, sms) == "regular"
    assert branch(threshold - 1, sms) == "swap_ab"


def test_one_token_is_unchanged_and_huge_batches_stay_regular():
    one = DispatchCase(1, 6, 50, 8, 78)
    assert (one.stock_branch, one.fixed_branch) == ("swap_ab", "swap_ab")
    big = DispatchCase(8192, 6, 50, 8, 78)
    assert big.fixed_m == 123 and big.fixed_branch == "regular"


@pytest.mark.parametrize("args", [(-1, 6, 50, 8), (1, 0, 50, 8), (1, 6, 0, 8), (1, 6, 50, 0)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        per_expert_expected_m(*args)


def _patch_statements() -> str:
    """The C++ statements of our FlashInfer patch that compute the estimate."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (patch,) = (root / "patches" / "flashinfer").glob("0001-*.patch")
    added = [ln[1:] for ln in patch.read_text().splitlines() if ln.startswith("+")]
    start = next(i for i, ln in enumerate(added) if "num_expert_slots =" in ln)
    end = next(i for i, ln in enumerate(added) if "num_expert_slots));" in ln)
    return "\n".join(added[start : end + 1])


def test_python_estimate_equals_the_patched_cpp(installed_fi, tmp_path):
    """Compile the patch's own statements (with FlashInfer's own ceilDiv) and compare."""
    import random
    import re
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    header = (
        installed_fi.csrc_dir / "nv_internal/include/tensorrt_llm/common/cudaUtils.h"
    ).read_text()
    ceil_div = re.search(
        r"template <typename T, typename U, [^\n]*\n[^\n]*\nauto constexpr ceilDiv\(.*?\n}\n",
        header,
        re.S,
    ).group(0)
    src = tmp_path / "estimate.cpp"
    src.write_text(
        "#include <algorithm>\n#include <cstddef>\n#include <cstdint>\n#include <iostream>\n"
        "#include <type_traits>\n"
        f"namespace tensorrt_llm::common {{\n{ceil_div}}}\n"
        "struct ParallelismConfig { int ep_size; };\n"
        "int main() {\n  long long r; int k, e, ep;\n"
        "  while (std::cin >> r >> k >> e >> ep) {\n"
        "    int64_t const num_rows = r; int const experts_per_token = k;\n"
        "    int const num_experts_per_node = e; ParallelismConfig parallelism_config{ep};\n"
        f"{_patch_statements()}\n"
        "    std::cout << expected_m_per_expert << '\\n';\n  }\n}\n"
    )
    exe = tmp_path / "estimate"
    subprocess.run([cxx, "-std=c++17", "-O1", str(src), "-o", str(exe)], check=True)
    rng = random.Random(0)
    cases = [(0, 6, 50, 8), (1, 6, 50, 8), (288, 6, 50, 8), (1 << 20, 8, 32, 8), (7, 1, 1, 1)]
    cases += [
        (rng.randrange(1 << 20), rng.randrange(1, 17), rng.randrange(1, 513), rng.randrange(1, 65))
        for _ in range(3000)
    ]
    out = subprocess.run(
        [str(exe)],
        input="".join(f"{r} {k} {e} {ep}\n" for r, k, e, ep in cases),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [int(x) for x in out] == [per_expert_expected_m(*c) for c in cases]
