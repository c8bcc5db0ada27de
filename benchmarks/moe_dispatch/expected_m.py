"""Which DeepGEMM kernel FlashInfer's SM90 FP8 block-scale MoE picks, stock vs fixed.

FlashInfer's ``grouped_gemm_dispatch`` (``fp8_blockscale_gemm_kernel.cuh``) chooses the
regular grouped GEMM (tiled on M) when ``expected_m >= threshold`` and the swap-A/B kernel
(the expert's N tiled as M) below it; the threshold is 64 on 78-SM GPUs (H20) and 32
elsewhere. Stock FlashInfer (<= 0.7.4) passes the global token count as ``expected_m``
(``CutlassFp8BlockScaleGemmRunner::getWorkspaceSize`` sets ``expected_m_ = shape_m``); the
rows each expert's GEMM really sees average ``tokens * top_k / physical experts``. These
pure functions mirror both so docs, tests and the GPU benchmark agree on the branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Branch = Literal["regular", "swap_ab"]
H20_SMS = 78


def per_expert_expected_m(tokens: int, top_k: int, local_experts: int, ep_size: int = 1) -> int:
    """``max(1, ceil(tokens * top_k / (local_experts * ep_size)))``: the average routed rows
    per physical expert slot (EPLB replicas included in ``local_experts * ep_size``).
    Integer arithmetic, exactly as the C++ fix computes it."""
    if tokens < 0 or top_k < 1 or local_experts < 1 or ep_size < 1:
        raise ValueError(
            f"need tokens >= 0 and top_k, local_experts, ep_size >= 1 "
            f"(got {tokens}, {top_k}, {local_experts}, {ep_size})"
        )
    slots = local_experts * ep_size
    return max(1, (tokens * top_k + slots - 1) // slots)


def stock_expected_m(tokens: int) -> int:
    """What FlashInfer <= 0.7.4 passes: the global token count."""
    return tokens


def swap_threshold(num_sms: int) -> int:
    """``m_per_expert_threshold`` of ``grouped_gemm_dispatch``."""
    return 64 if num_sms == H20_SMS else 32


FIT_STEP = 16  # kFitStep: a fitted row tile is a multiple of this
MAX_FIT_N = 128  # kMaxFitN: the widest swap-A/B row tile


def fit_n(num_rows: int) -> int:
    """The fitted launch's widest row tile for a step of `num_rows` tokens (plan_launches in
    the patched fp8_blockscale_gemm_kernel.cuh): a token picks an expert once, so no expert
    holds more than num_rows rows."""
    return min(MAX_FIT_N, -(-max(num_rows, 1) // FIT_STEP) * FIT_STEP)


def split_rows(num_sms: int) -> int | None:
    """split_rows_for in the patched fp8_blockscale_gemm_kernel.cuh: the token count above which
    the experts with more than MAX_FIT_N rows go to the regular kernel in a second launch (None:
    never, one fitted launch)."""
    del num_sms
    return None


def launch_plan(num_rows: int, num_sms: int) -> tuple[int, int]:
    """(widest fitted row tile, regular launch's rows or 0): plan_launches for a step of
    num_rows tokens on a GPU with num_sms SMs."""
    split = split_rows(num_sms)
    regular = num_rows if split is not None and num_rows > max(split, MAX_FIT_N) else 0
    return fit_n(num_rows), regular


def fitted_tiles(rows: int, widest: int) -> list[int]:
    """The row tiles the fitted kernel gives an expert with `rows` rows: widest-row tiles, the
    last narrowed to the rest rounded up to FIT_STEP (fitted_tile_n in fp8_gemm_impl.cuh)."""
    full, rest = divmod(rows, widest)
    return [widest] * full + ([-(-rest // FIT_STEP) * FIT_STEP] if rest else [])


def branch(expected_m: int, num_sms: int) -> Branch:
    return "regular" if expected_m >= swap_threshold(num_sms) else "swap_ab"


@dataclass(frozen=True)
class DispatchCase:
    """One MoE call as one EP rank sees it (with TP+EP every rank sees all tokens)."""

    tokens: int
    top_k: int
    local_experts: int
    ep_size: int
    num_sms: int

    @property
    def stock_m(self) -> int:
        return stock_expected_m(self.tokens)

    @property
    def fixed_m(self) -> int:
        return per_expert_expected_m(self.tokens, self.top_k, self.local_experts, self.ep_size)

    @property
    def stock_branch(self) -> Branch:
        return branch(self.stock_m, self.num_sms)

    @property
    def fixed_branch(self) -> Branch:
        return branch(self.fixed_m, self.num_sms)

    @property
    def changes(self) -> bool:
        return self.stock_branch != self.fixed_branch
