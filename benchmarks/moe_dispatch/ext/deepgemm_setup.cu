// The one DeepGEMM call the benchmark needs outside FlashInfer's runner, kept out of the torch
// binding: torch's headers need C++20 while FlashInfer's CUDA sources build as C++17.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tensorrt_llm/deep_gemm/compiler.cuh"

#ifdef VLLM_H20_FORCE_HOOK
// Read by the calibration build's grouped_gemm_dispatch: 0 = its own choice, 1 = regular,
// -1 = swap-A/B (run.py checks its one-line substitution when it makes it).
int vllm_h20_force_branch = 0;

// The SM count the calibration build's kernels plan for (grid size, tile choice, swap
// threshold): VLLM_H20_NUM_SMS=78 makes an H200 dispatch like an H20. -1 = the device's.
int vllm_h20_num_sms_override() {
  char const* v = std::getenv("VLLM_H20_NUM_SMS");
  return v && std::atoi(v) > 0 ? std::atoi(v) : -1;
}
#endif

void vllm_h20_set_include_dirs(std::vector<std::string> const& dirs) {
  std::vector<std::filesystem::path> paths(dirs.begin(), dirs.end());
  deep_gemm::jit::Compiler::setIncludeDirs(paths);
}

bool vllm_h20_force_branch_set(int which) {
#ifdef VLLM_H20_FORCE_HOOK
  vllm_h20_force_branch = which;
  return true;
#else
  return which == 0;
#endif
}
