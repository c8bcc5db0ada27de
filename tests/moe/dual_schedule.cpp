// The per-expert split's schedule on the host (tests/moe/test_deepgemm_one_launch.py): a series'
// scheduler.cuh compiled as C++, one std::thread per lane of a warp and the warp intrinsics as
// barrier exchanges, so the warp-wide code (split_grid, find_first_tile) runs as written. The
// candidates/one-launch series (default): fp8_gemm_kernel_dual's one launch, its grid split
// between the classes; -DTWO_LAUNCHES (the shipped series): each class's own launch over the
// whole grid. For each case it prints the split ("split HOT_CTAS", or "split two" for two
// launches), then every tile each CTA's walk visits ("hot|cold CTA GROUP M_BLOCK N_BLOCK"), then
// "end".
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
struct Dim3 {
  unsigned x = 0;
};
thread_local Dim3 threadIdx;
thread_local Dim3 blockIdx;
Dim3 gridDim;
template <class T>
T __ldg(T const* p) {
  return *p;
}
using std::min;

static std::barrier<> warp_bar{32};
static uint32_t warp_v[32];
static uint32_t lane_id() { return threadIdx.x % 32; }
static uint32_t exchange(uint32_t x, uint32_t src) {
  warp_v[lane_id()] = x;
  warp_bar.arrive_and_wait();
  uint32_t const r = warp_v[src];
  warp_bar.arrive_and_wait();
  return r;
}
uint32_t __shfl_sync(unsigned, uint32_t x, uint32_t src) { return exchange(x, src); }
uint32_t __shfl_up_sync(unsigned, uint32_t x, uint32_t d) {
  return exchange(x, lane_id() >= d ? lane_id() - d : lane_id());
}
uint32_t __ballot_sync(unsigned, bool pred) {
  warp_v[lane_id()] = pred ? 1u : 0u;
  warp_bar.arrive_and_wait();
  uint32_t mask = 0;
  for (uint32_t l = 0; l < 32; ++l) mask |= warp_v[l] << l;
  warp_bar.arrive_and_wait();
  return mask;
}
uint32_t __reduce_add_sync(unsigned, uint32_t x) {
  warp_v[lane_id()] = x;
  warp_bar.arrive_and_wait();
  uint32_t sum = 0;
  for (uint32_t l = 0; l < 32; ++l) sum += warp_v[l];
  warp_bar.arrive_and_wait();
  return sum;
}
int __ffs(uint32_t x) { return __builtin_ffs(static_cast<int>(x)); }

#include "deep_gemm/scheduler.cuh"

using namespace deep_gemm;

// V4.1-Flash FC1 on one EP8 rank as the dispatch plans it on an H200 (N 4608, hot tiles 128 x
// 128, cold 128 weight rows x 16 tokens), at several group counts and class boundaries.
constexpr uint32_t N = 4608;

struct Case {
  uint32_t ctas, hot_cost, cold_cost;
  std::vector<int64_t> offsets;
};

template <uint32_t G, uint32_t B>
void simulate(Case const& c, uint32_t lane, std::vector<std::string>& out) {
  using Hot = GroupedWithOffsetScheduler<N, 128, 128, G, 1, N / 128, 16, B + 1, kAnyRows>;
  using Cold = GroupedWithOffsetSchedulerSwapAB<N, 128, 16, G, 1, N / 128, 16, 1, B>;
  threadIdx.x = lane;
  int64_t* offsets = const_cast<int64_t*>(c.offsets.data());
#ifdef TWO_LAUNCHES
  // the hot class's launch, then the cold class's, each over the whole grid
  if (lane == 0) out.push_back("split two");
  gridDim.x = c.ctas;
  for (uint32_t launch = 0; launch < 2 * c.ctas; ++launch) {
    bool const hot = launch < c.ctas;
    uint32_t const idx = launch % c.ctas, count = c.ctas;
    blockIdx.x = idx;
    uint32_t const cta = launch;
#else
  uint32_t const hot_ctas =
      split_grid<G, Hot, Cold>(offsets, c.ctas, DualTileCost{c.hot_cost, c.cold_cost});
  if (lane == 0) out.push_back("split " + std::to_string(hot_ctas));
  for (uint32_t cta = 0; cta < c.ctas; ++cta) {
    bool const hot = cta < hot_ctas;
    uint32_t const idx = hot ? cta : cta - hot_ctas, count = hot ? hot_ctas : c.ctas - hot_ctas;
#endif
    FirstTile first;
    if (hot) {
      GroupedWithOffsetSchedulerInput in{0, offsets};
      first = Hot::first_tile(in, idx);
    } else {
      GroupedWithOffsetSchedulerInputSwapAB in{0, offsets};
      first = Cold::first_tile(in, idx);
    }
    // every lane must agree (the kernel's CTAs leave or start from it)
    uint32_t const found0 = exchange(first.found ? 1u : 0u, 0), group0 = exchange(first.group, 0),
                   cumsum0 = exchange(first.cumsum, 0);
    bool const same = (first.found ? 1u : 0u) == found0 && first.group == group0 &&
                      first.cumsum == cumsum0;
    uint32_t const agree = __ballot_sync(0xffffffffu, same);
    if (lane != 0) continue;
    if (agree != 0xffffffffu) out.push_back("lanes-disagree " + std::to_string(cta));
    if (!first.found) continue;
    uint32_t m = 0, n = 0;
    auto walk = [&](auto& s) {
#ifdef TWO_LAUNCHES
      (void)count;
      s.start_at(first);
#else
      s.start_at(first, idx, count);
#endif
      while (s.get_next_block(m, n))
        out.push_back(std::string(hot ? "hot " : "cold ") + std::to_string(cta) + " " +
                      std::to_string(s.curr_group_idx) + " " + std::to_string(m) + " " +
                      std::to_string(n));
    };
    if (hot) {
      GroupedWithOffsetSchedulerInput in{0, offsets};
      Hot s(in);
      walk(s);
    } else {
      GroupedWithOffsetSchedulerInputSwapAB in{0, offsets};
      Cold s(in);
      walk(s);
    }
  }
}

template <uint32_t G, uint32_t B>
void run(Case const& c) {
  std::vector<std::string> out;
  std::vector<std::thread> lanes;
  for (uint32_t l = 0; l < 32; ++l) lanes.emplace_back([&, l] { simulate<G, B>(c, l, out); });
  for (auto& t : lanes) t.join();
  for (auto const& line : out) std::cout << line << "\n";
  std::cout << "end\n";
}

// stdin, one case a line: groups boundary ctas hot_cost cold_cost rows_0 ... rows_{groups-1}
int main() {
  uint32_t g, b;
  while (std::cin >> g >> b) {
    Case c;
    std::cin >> c.ctas >> c.hot_cost >> c.cold_cost;
    c.offsets.assign(1, 0);
    for (uint32_t i = 0; i < g; ++i) {
      int64_t rows;
      std::cin >> rows;
      c.offsets.push_back(c.offsets.back() + rows);
    }
#define CASE(G, B) \
  if (g == G && b == B) { run<G, B>(c); continue; }
    CASE(8, 16) CASE(50, 16) CASE(50, 48) CASE(100, 32)
#undef CASE
    std::cout << "unsupported " << g << " " << b << "\nend\n";
  }
}
