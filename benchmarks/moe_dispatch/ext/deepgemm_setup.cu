// The one DeepGEMM call the benchmark needs outside FlashInfer's runner, kept out of the torch
// binding: torch's headers need C++20 while FlashInfer's CUDA sources build as C++17.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tensorrt_llm/deep_gemm/compiler.cuh"

#ifdef VLLM_H20_FORCE_HOOK
#include <algorithm>
#include <cmath>

// Read by the calibration build's grouped_gemm_dispatch: 0 = its own choice, 1 = regular,
// -1 = swap-A/B, as one launch for every expert (run.py checks its substitutions).
int vllm_h20_force_branch = 0;

// The calibration build's row-class rule (set_rule): mode 0 = the patch's own plan, 1 = one launch
// chosen from expected_m (the average-only fix), 2 = the rule below. sizing: what the swap-A/B
// tiles are sized for, 1 = expected_m, 2 = the busiest expert of balanced routing. boundary: > 0
// fixed rows; -1 = by num_rows (128 up to 512, 64 up to 2048, else 32); -2 = the busiest expert
// rounded up to 8 (at least the threshold); -3 = twice that. hot_first: launch order; overlap:
// the second launch may start while the first runs (programmatic dependent launch).
int vllm_h20_rule_mode = 0, vllm_h20_rule_sizing = 2, vllm_h20_rule_boundary = -2;
int vllm_h20_hot_first = 0, vllm_h20_overlap = 1;  // the patch's order and overlap
// One launch when num_rows is at most this (0: never forced).
int vllm_h20_rule_single_below = 128;

bool vllm_h20_single_launch() { return vllm_h20_force_branch != 0 || vllm_h20_rule_mode == 1; }

void vllm_h20_override_plan(unsigned expected_m, unsigned max_m, unsigned threshold,
                            unsigned& cold_m, unsigned& boundary, unsigned& hot_m) {
  if (vllm_h20_rule_mode != 2) return;
  unsigned const m = std::max(expected_m, 1u);
  unsigned const busiest = m + static_cast<unsigned>(std::ceil(3.0 * std::sqrt(double(m))));
  unsigned const busy8 = std::max(threshold, std::min(128u, (busiest + 7) / 8 * 8));
  int const b = vllm_h20_rule_boundary;
  boundary = b > 0 ? unsigned(b)
             : b == -1 ? (max_m <= 512 ? 128u : max_m <= 2048 ? 64u : 32u)
             : b == -2 ? busy8
                       : std::min(128u, 2 * busy8);
  if (vllm_h20_rule_single_below > 0 && max_m <= unsigned(vllm_h20_rule_single_below)) {
    boundary = max_m;  // no expert can exceed it: one launch
  }
  cold_m = std::min(vllm_h20_rule_sizing == 1 ? m : busiest, boundary);
  hot_m = max_m;
}

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

bool vllm_h20_rule_set(int mode, int sizing, int boundary, int hot_first, int overlap) {
#ifdef VLLM_H20_FORCE_HOOK
  vllm_h20_rule_mode = mode;
  vllm_h20_rule_sizing = sizing;
  vllm_h20_rule_boundary = boundary;
  vllm_h20_hot_first = hot_first;
  vllm_h20_overlap = overlap;
  return true;
#else
  return mode == 0;
#endif
}

bool vllm_h20_force_branch_set(int which) {
#ifdef VLLM_H20_FORCE_HOOK
  vllm_h20_force_branch = which;
  return true;
#else
  return which == 0;
#endif
}
