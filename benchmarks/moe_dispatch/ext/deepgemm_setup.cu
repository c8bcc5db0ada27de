// The one DeepGEMM call the benchmark needs outside FlashInfer's runner, kept out of the torch
// binding: torch's headers need C++20 while FlashInfer's CUDA sources build as C++17. In the
// calibration build (VLLM_H20_CALIB: FlashInfer's sources with the series and calib.patch),
// also the switches calib.patch's lines read.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tensorrt_llm/deep_gemm/compiler.cuh"

#ifdef VLLM_H20_CALIB
#include <algorithm>

namespace {
int env_int(char const* name) {
  char const* v = std::getenv(name);
  return v && std::atoi(v) > 0 ? std::atoi(v) : -1;
}
bool vllm_h20_single = false;
}  // namespace

// What calib.patch declares inside fp8_blockscale_gemm_kernel.cuh, so in its namespace.
namespace tensorrt_llm::kernels::fp8_blockscale_gemm {
// force_branch: 0 = the dispatch's own choice; with single_launch, one launch for every expert
// with 1 = the regular kernel, -1 = swap-A/B (the forced-rows calibration).
int vllm_h20_force_branch = 0;

bool vllm_h20_single_launch() { return vllm_h20_single || vllm_h20_force_branch != 0; }

// The SM count the dispatch plans for (tile choice, swap threshold, ridge; also the grid unless
// VLLM_H20_GRID_SMS says otherwise): VLLM_H20_NUM_SMS=78 makes an H200 dispatch like an H20.
// -1 = the device's.
int vllm_h20_num_sms_override() { return env_int("VLLM_H20_NUM_SMS"); }
}  // namespace tensorrt_llm::kernels::fp8_blockscale_gemm

// Global (calib.patch declares it in fp8_gemm.cuh before its namespace): the CTAs a persistent
// launch gets. VLLM_H20_GRID_SMS=40 runs every kernel on 40 of the H200's SMs, whose FP8
// tensor rate (40/132 of ~990 TFLOP/s) is an H20's (296); else the planned count.
int vllm_h20_grid(int planned) {
  int const grid = env_int("VLLM_H20_GRID_SMS");
  return grid > 0 ? std::min(grid, planned) : planned;
}
#endif

void vllm_h20_set_include_dirs(std::vector<std::string> const& dirs) {
  std::vector<std::filesystem::path> paths(dirs.begin(), dirs.end());
  deep_gemm::jit::Compiler::setIncludeDirs(paths);
}

bool vllm_h20_switch(int force, bool single) {
#ifdef VLLM_H20_CALIB
  tensorrt_llm::kernels::fp8_blockscale_gemm::vllm_h20_force_branch = force;
  vllm_h20_single = single;
  return true;
#else
  return force == 0 && !single;
#endif
}
