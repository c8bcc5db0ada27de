// The one DeepGEMM call the benchmark needs outside FlashInfer's runner, kept out of the torch
// binding: torch's headers need C++20 while FlashInfer's CUDA sources build as C++17.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tensorrt_llm/deep_gemm/compiler.cuh"

#ifdef VLLM_H20_FORCE_HOOK
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

// Read by the calibration build's grouped_gemm_dispatch (run.py checks its substitutions).
// force_branch: 0 = its own choice; one launch for every expert with 1 = the regular kernel,
// -1 = swap-A/B, 2 = the fitted swap-A/B kernel (widest tile: expected_m rounded up to 16).
int vllm_h20_force_branch = 0;

// The calibration build's rule (set_rule). mode 0 = the patch's plan (fitted tiles, split as the
// patch decides for this GPU); 1 = one launch chosen from expected_m (the average-only fix,
// patch 0001 alone); 3 = the previous per-expert plan (two row classes: swap-A/B tiles sized for
// the busiest expert of balanced routing, the regular kernel above a boundary; one launch up to
// 128 tokens); 4 / 5 = 3 / 0 with the largest carveout; whole-expert-tile series only: 6 = its
// two row classes with the hot (regular) launch first and the cold one overlapping it, 7 = one
// swap-A/B launch sized for max_m when max_m <= 128 (else the split), 8 = candidates/hot-first's
// rule (one swap-A/B launch up to 32 rows, one regular launch up to 64 where 64 rows are under
// the GPU's ridge, else mode 6); candidates/one-launch only: 9 = the shipped series' dispatch
// (the dual launch off: two launches, hot class first); the shipped (hot-first) series only:
// 10 = its hot launch alone (a diagnostic), 11 = its split without the overlap, 12 / 13 = its
// classes on two forked branches, the hot launch issued first / second, 14 / 15 / 29-32 = its
// class kernels with parts switched (run.py HOT_FIRST_SPLIT_HOOK). split_rows (mode 0, 5):
// 0 = the patch's own; else a second, regular launch for the
// experts with more than 128 rows whenever the token count exceeds it.
int vllm_h20_rule_mode = 0, vllm_h20_rule_split_rows = 0;

bool vllm_h20_single_launch() { return vllm_h20_force_branch != 0 || vllm_h20_rule_mode == 1; }

bool vllm_h20_prev_plan() { return vllm_h20_rule_mode == 3 || vllm_h20_rule_mode == 4; }

// Modes 4 and 5: mode 3 / 0 with every kernel preferring the largest shared-memory carveout, so
// consecutive kernels of other shared-memory sizes never make the SMs reconfigure.
bool vllm_h20_carveout() { return vllm_h20_rule_mode == 4 || vllm_h20_rule_mode == 5; }

unsigned vllm_h20_split_rows(unsigned patch_rows) {
  return vllm_h20_rule_split_rows > 0 ? unsigned(vllm_h20_rule_split_rows) : patch_rows;
}

// The previous patch's plan_row_classes: cold_m (rows the swap-A/B tiles are sized for), boundary
// (experts with 1..boundary rows run swap-A/B), hot_m (the regular launch's sizing).
void vllm_h20_prev_row_classes(unsigned expected_m, unsigned max_m, unsigned threshold,
                               unsigned& cold_m, unsigned& boundary, unsigned& hot_m) {
  unsigned const m = std::max(expected_m, 1u);
  unsigned const busiest = m + static_cast<unsigned>(std::ceil(3.0 * std::sqrt(double(m))));
  boundary = max_m <= 128 ? max_m : std::max(threshold, std::min(128u, (busiest + 7) / 8 * 8));
  cold_m = std::min(busiest, boundary);
  hot_m = max_m;
}

// The SM count the calibration build's kernels plan for (tile choice, swap threshold; also the
// grid unless VLLM_H20_GRID_SMS says otherwise): VLLM_H20_NUM_SMS=78 makes an H200 dispatch like
// an H20. -1 = the device's.
int vllm_h20_num_sms_override() {
  char const* v = std::getenv("VLLM_H20_NUM_SMS");
  return v && std::atoi(v) > 0 ? std::atoi(v) : -1;
}

// Rule modes 12 and 13: the two row classes on two branches of the caller's stream, forked before
// them and joined after (in a CUDA graph: parallel kernel nodes). One side stream and two events
// per device, made on the first call (the harness makes one outside any graph capture).
namespace {
struct Branch {
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

Branch& branch() {
  static Branch per_device[64];
  int device = 0;
  cudaGetDevice(&device);
  Branch& b = per_device[device];
  if (b.side == nullptr) {
    cudaStreamCreateWithFlags(&b.side, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&b.fork, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&b.join, cudaEventDisableTiming);
  }
  return b;
}
}  // namespace

cudaStream_t vllm_h20_fork(cudaStream_t stream) {
  Branch& b = branch();
  cudaEventRecord(b.fork, stream);
  cudaStreamWaitEvent(b.side, b.fork, 0);
  return b.side;
}

void vllm_h20_join(cudaStream_t stream, cudaStream_t side) {
  Branch& b = branch();
  cudaEventRecord(b.join, side);
  cudaStreamWaitEvent(stream, b.join, 0);
}

// The CTAs a persistent launch gets: VLLM_H20_GRID_SMS=40 runs every kernel on 40 of the H200's
// SMs, whose FP8 tensor rate (40/132 of ~990 TFLOP/s) is an H20's (296); else the planned count.
int vllm_h20_grid(int planned) {
  char const* v = std::getenv("VLLM_H20_GRID_SMS");
  return v && std::atoi(v) > 0 ? std::min(std::atoi(v), planned) : planned;
}
#endif

void vllm_h20_set_include_dirs(std::vector<std::string> const& dirs) {
  std::vector<std::filesystem::path> paths(dirs.begin(), dirs.end());
  deep_gemm::jit::Compiler::setIncludeDirs(paths);
}

bool vllm_h20_rule_set(int mode, int split_rows) {
#ifdef VLLM_H20_FORCE_HOOK
  vllm_h20_rule_mode = mode;
  vllm_h20_rule_split_rows = split_rows;
  return true;
#else
  return mode == 0 && split_rows == 0;
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
