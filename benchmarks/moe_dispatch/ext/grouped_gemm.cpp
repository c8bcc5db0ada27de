// The grouped FP8 block-scale GEMM exactly as FlashInfer's fused MoE issues it for FC1/FC2:
// CutlassFp8BlockScaleGemmRunner<bf16, fp8, bf16> from FlashInfer's own
// fp8_blockscale_gemm.cu (compiled beside this file from one version's patched sources, or
// the calibration build's: the series + calib.patch), sized with getWorkspaceSize() the way
// CutlassMoeFCRunner::getWorkspaceDeviceBufferSizes() calls it, then moeGemm() on the routed
// rows laid out per expert (expert_first_token_offset).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.h"

// deepgemm_setup.cu (CUDA, C++17)
void vllm_h20_set_include_dirs(std::vector<std::string> const& dirs);
bool vllm_h20_switch(int force, bool single);

using Runner = tensorrt_llm::kernels::fp8_blockscale_gemm::CutlassFp8BlockScaleGemmRunner<
    __nv_bfloat16, __nv_fp8_e4m3, __nv_bfloat16>;

struct GroupedGemm {
  Runner runner;
  int64_t n, k, workspace_bytes = 0;

  // num_rows: the tokens the MoE layer sees; the runner sizes for num_rows * top_k rows.
  // expected_m: what the patched MoE runner passes (ignored by the stock build, which uses
  // num_rows: that is the bug).
  GroupedGemm(int64_t num_rows, int64_t n_, int64_t k_, int64_t top_k, int64_t num_problems,
              int64_t expected_m)
      : n(n_), k(k_) {
#ifdef VLLM_H20_PATCHED
    workspace_bytes = runner.getWorkspaceSize(num_rows, n, k, top_k, num_problems, expected_m);
#else
    (void)expected_m;
    workspace_bytes = runner.getWorkspaceSize(num_rows, n, k, top_k, num_problems);
#endif
  }

  void run(torch::Tensor out, torch::Tensor a, torch::Tensor b, torch::Tensor b_scales,
           torch::Tensor offsets, torch::Tensor workspace) {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16 && a.is_contiguous(), "a: bf16 rows x K");
    TORCH_CHECK(b.scalar_type() == at::kFloat8_e4m3fn && b.is_contiguous(), "b: fp8 E x N x K");
    TORCH_CHECK(b_scales.scalar_type() == at::kFloat && b_scales.is_contiguous(), "b_scales");
    TORCH_CHECK(offsets.scalar_type() == at::kLong, "offsets: int64 [E + 1]");
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.size(1) == n, "out: bf16 rows x N");
    TORCH_CHECK(a.size(1) == k && b.size(1) == n && b.size(2) == k, "shapes");
    TORCH_CHECK(workspace.numel() >= workspace_bytes, "workspace too small");
    at::cuda::CUDAGuard guard(a.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    runner.configureWorkspace(reinterpret_cast<char*>(workspace.data_ptr()));
    runner.moeGemm(out.data_ptr(), a.data_ptr(), b.data_ptr(),
                   reinterpret_cast<int64_t const*>(offsets.data_ptr()), b.size(0), n, k, stream,
                   nullptr, b_scales.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

void set_include_dirs(std::vector<std::string> dirs) { vllm_h20_set_include_dirs(dirs); }

// The calibration build's switches (calib.patch): force = 1 regular, -1 swap-A/B, 0 the
// dispatch's own; single = one launch chosen from expected_m.
void set_switches(int64_t force, bool single) {
  TORCH_CHECK(vllm_h20_switch(static_cast<int>(force), single),
              "this build has no switches (only the calibration build has)");
}

bool patched() {
#ifdef VLLM_H20_PATCHED
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<GroupedGemm>(m, "GroupedGemm", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def_readonly("workspace_bytes", &GroupedGemm::workspace_bytes)
      .def("run", &GroupedGemm::run);
  m.def("set_include_dirs", &set_include_dirs);
  m.def("set_switches", &set_switches);
  m.def("patched", &patched);
}
