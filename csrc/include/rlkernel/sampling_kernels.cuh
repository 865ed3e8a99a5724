// The fused sampler's kernels.
//  fast path (1 <= top_k <= kMaxFastK, or T = 0):
//    rlkernel_sample_candidates: one block per 8192-token chunk of a row reads it once and keeps a superset of
//      the chunk's top-k: every token >= L, L <= the k-th largest of the block's 256 per-thread maxima (at least
//      k tokens are >= L, so the chunk's k-th largest, and every token tied with it, is >= L).
//    rlkernel_sample_select: one block per row stages the candidates of all chunks in shared memory (a few
//      thousand: the row's top-k is among them, ties included); its warps sort runs of 128 and merge them,
//      keeping the best 128 (warp shuffles, no block barrier but two per merge level), and warp 0 runs the exact
//      law on the first k (finish_sorted). A row whose candidates overflow runs the law on the whole row.
//  general path (top_k = 0 or large): rlkernel_sample_rows runs the exact law on each whole row.
// Both paths keep the same set and race the same Philox noise per (row, id): they draw the same ids.
#pragma once

#include "rlkernel/sampling_filter.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kCandThreads = 256;
constexpr int kVec = 4;                                   // tokens per vector load
constexpr int kVecsPerThread = 8;                         // 32 tokens per thread
constexpr int kChunk = kCandThreads * kVec * kVecsPerThread;  // 8192 tokens per block
constexpr int kBoundBits = 14;  // bits of L the candidates kernel decides below its maxima's common prefix
constexpr int kMaxFastK = 128;
constexpr int kCandCap = 4 * kMaxFastK;  // candidates one chunk may keep before its row overflows
constexpr int kRowThreads = 512;
// Candidates a select block sorts (32 KiB, sharing shared memory with the whole-row path's histograms): a row
// with more (many ties at its k-th value) takes the whole-row path.
constexpr int kMaxSmemCand = 4096;
constexpr int kRun = 128;  // values one warp sorts (4 per lane)
static_assert(kMaxFastK <= kRun, "finish_sorted: the first k of one sorted run");
static_assert(kMaxSmemCand % kRun == 0, "whole runs");

template <typename T>
__device__ __forceinline__ void load4(const T* p, int64_t base, int64_t vocab, bool aligned, float out[kVec]) {
  if (aligned && base + kVec <= vocab) {
    if constexpr (sizeof(T) == 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p + base));
      out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p + base));
      const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] = to_float(h[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = base + i < vocab ? to_float(__ldg(p + base + i)) : 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kCandThreads)
    rlkernel_sample_candidates(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, int splits,
                               float inv_t, int k, uint64_t* __restrict__ cand, uint32_t* __restrict__ counts,
                               int32_t* __restrict__ first_bad) {
  __shared__ uint32_t any_all[2][kCandThreads / 32];
  __shared__ uint32_t n_cand;
  if (threadIdx.x == 0) n_cand = 0;  // published by the barriers of the bound search
  if (blockIdx.x == 0 && threadIdx.x == 0) *first_bad = kNoBadRow;  // the select kernel runs after: stream order
  const int64_t row = blockIdx.x / splits;
  const int split = blockIdx.x % splits;
  const T* p = logits + row * row_stride;
  const int64_t start = static_cast<int64_t>(split) * kChunk;
  const bool aligned = reinterpret_cast<uintptr_t>(p) % (kVec * sizeof(T)) == 0;

  // vector j of thread t covers tokens start + (j * threads + t) * 4 ...: coalesced across the warp
  uint32_t keys[kVecsPerThread * kVec];
  if (aligned && start + kChunk <= vocab) {  // a whole aligned chunk (all but a row's last): no bounds checks
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      float x[kVec];
      load4(p, start + (j * kCandThreads + static_cast<int>(threadIdx.x)) * kVec, vocab, true, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) keys[j * kVec + i] = float_key(scaled(x[i], inv_t));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int64_t base = start + (static_cast<int64_t>(j) * kCandThreads + threadIdx.x) * kVec;
      float x[kVec];
      load4(p, base, vocab, aligned, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) keys[j * kVec + i] = base + i < vocab ? float_key(scaled(x[i], inv_t)) : kNoKey;
    }
  }
  uint32_t tmax = kNoKey;
#pragma unroll
  for (int e = 0; e < kVecsPerThread * kVec; ++e) tmax = max(tmax, keys[e]);
  // L: at least k per-thread maxima are >= L (so >= k tokens are), found bit by bit from the top, each bit kept
  // while that still holds (L = the k-th largest maximum, or 0 when fewer than k threads hold tokens). Every
  // maximum shares the bits above the highest bit where they differ (OR ^ AND), so the search starts below it
  // and stops after kBoundBits bits, the rest left 0: L may end a little lower (a few more candidates, never a
  // lost one) for a third of the barriers.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t w_any = __reduce_or_sync(kFullMask, tmax), w_all = __reduce_and_sync(kFullMask, tmax);
  if (lane == 0) {
    any_all[0][warp] = w_any;
    any_all[1][warp] = w_all;
  }
  __syncthreads();
  uint32_t any = 0, all = ~0u;
#pragma unroll
  for (int w = 0; w < kCandThreads / 32; ++w) {
    any |= any_all[0][w];
    all &= any_all[1][w];
  }
  const uint32_t differ = any ^ all;
  const int high = differ ? 31 - __clz(static_cast<int>(differ)) : -1;
  uint32_t bound = high < 0 ? any : any & ~((2u << high) - 1u);  // the common prefix: all 256 maxima are >= it
  for (int b = high; b >= 0 && b > high - kBoundBits; --b) {
    const uint32_t c = bound | (1u << b);
    if (__syncthreads_count(tmax >= c) >= k) bound = c;
  }
  bound = max(bound, 1u);  // never keep padding (kNoKey)
  // Emit in whatever order the shared counter hands out slots: select sorts the candidates by their (unique)
  // packed value, so the order here changes nothing downstream.
  uint64_t* out = cand + static_cast<int64_t>(blockIdx.x) * kCandCap;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const uint32_t key = keys[j * kVec + i];
      if (key >= bound) {
        const uint32_t pos = atomicAdd(&n_cand, 1u);
        const int64_t id = start + (static_cast<int64_t>(j) * kCandThreads + threadIdx.x) * kVec + i;
        if (pos < kCandCap) out[pos] = pack_desc(key, id);  // beyond the cap the row overflows (select checks)
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) counts[blockIdx.x] = n_cand;
}

// ---- one warp sorts kRun packed values, descending: element e = 4 * lane + r is v[r] of that lane ----

// One bitonic stage on the pairs (e, e ^ stride): the lower index takes the larger value where bit `size` of e
// is clear, the smaller where it is set (size 0: every pair descending, as the merge needs).
template <int kSize, int kStride>
__device__ __forceinline__ void warp_stage(uint64_t v[4]) {
  const int lane = threadIdx.x % 32;
  if constexpr (kStride >= 4) {  // the partner is lane ^ (stride / 4), same register
    constexpr int kLanes = kStride / 4;
    const bool lower = (lane & kLanes) == 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool desc = ((lane * 4 + r) & kSize) == 0;
      const uint64_t o = __shfl_xor_sync(kFullMask, v[r], kLanes);
      v[r] = (lower == desc) ? (v[r] > o ? v[r] : o) : (v[r] < o ? v[r] : o);
    }
  } else {  // the partner is in this lane's registers
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if ((r & kStride) == 0) {
        const bool desc = ((lane * 4 + r) & kSize) == 0;
        const uint64_t a = v[r], b = v[r + kStride];
        const bool swap = desc ? a < b : a > b;
        v[r] = swap ? b : a;
        v[r + kStride] = swap ? a : b;
      }
    }
  }
}

template <int kSize, int kStride>
__device__ __forceinline__ void warp_merge_stages(uint64_t v[4]) {  // strides kStride, kStride / 2, ..., 1
  warp_stage<kSize, kStride>(v);
  if constexpr (kStride > 1) warp_merge_stages<kSize, kStride / 2>(v);
}

template <int kSize = 2>
__device__ __forceinline__ void warp_sort_run(uint64_t v[4]) {  // any 128 values -> descending
  warp_merge_stages<kSize, kSize / 2>(v);
  if constexpr (kSize < kRun) warp_sort_run<kSize * 2>(v);
}

// v, u: descending runs. v becomes the 128 largest of both, descending: max(v[e], u[127 - e]) is bitonic and
// holds them (a half-cleaner of v followed by reversed u), and a bitonic merge sorts it.
__device__ __forceinline__ void warp_merge_top(uint64_t v[4], const uint64_t u[4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint64_t x = __shfl_sync(kFullMask, u[3 - r], 31 - lane);  // element 127 - e of u
    v[r] = v[r] > x ? v[r] : x;
  }
  warp_merge_stages<0, kRun / 2>(v);
}

__device__ __forceinline__ void load_run(const uint64_t* src, int n, uint64_t u[4]) {  // entries >= n: 0
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 4; ++r) u[r] = lane * 4 + r < n ? src[lane * 4 + r] : 0;  // 0 is below every real entry
}

// Warp 0, holding the row's 128 best candidates in (key desc, id asc) order (v, as warp_sort_run lays them out;
// n >= 1 real ones): the same law as filter_and_draw on the first m = min(top_k, n), in the same integer
// arithmetic, so the same kept set (and, with the same Philox noise per (row, id), the same drawn id).
__device__ __forceinline__ void finish_sorted(const uint64_t v[4], int n, const FilterArgs& a) {
  const int lane = threadIdx.x % 32;
  const uint64_t top = __shfl_sync(kFullMask, v[0], 0);
  const uint32_t top_key = static_cast<uint32_t>(top >> 32);
  const float s_max = key_float(top_key);
  const bool bad = a.argmax ? (top_key == kNanKey || top_key <= float_key(-INFINITY))
                            : (top_key == kNanKey || isinf(s_max));  // NaN sorts first: it is the top
  if (bad || a.argmax) {
    if (lane == 0) {
      a.ids[a.row] = bad ? -1 : unpack_id(top);
      if (bad) atomicMin(a.first_bad, static_cast<int32_t>(a.row));
    }
    return;
  }
  const int m = a.top_k < n ? static_cast<int>(a.top_k) : n;
  uint64_t w[4], local = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    w[r] = lane * 4 + r < m ? fixed_weight(static_cast<uint32_t>(v[r] >> 32), s_max) : 0;
    local += w[r];
  }
  uint64_t inc = local;  // inclusive prefix over lanes: entries 0 .. 4 * lane + 3
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t x = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += x;
  }
  const uint64_t z = __shfl_sync(kFullMask, inc, 31);
  const bool p_on = a.top_p < 1.0;
  const uint64_t target = top_p_target(a.top_p, z);
  uint64_t before = inc - local;  // mass of the entries ahead of this lane's first
  float bs = -INFINITY;
  int64_t bi = INT64_MAX;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (lane * 4 + r < m && (!p_on || before < target)) {  // top-p: kept while the mass before it is < top_p * Z
      const int64_t id = unpack_id(v[r]);
      const float sc = race_score(key_float(static_cast<uint32_t>(v[r] >> 32)), a.rng, a.row, id);
      if (better(sc, id, bs, bi)) {
        bs = sc;
        bi = id;
      }
    }
    before += w[r];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float so = __shfl_xor_sync(kFullMask, bs, o);
    const int64_t io = __shfl_xor_sync(kFullMask, bi, o);
    if (better(so, io, bs, bi)) {
      bs = so;
      bi = io;
    }
  }
  if (lane == 0) a.ids[a.row] = bi;
}

struct SelectSmem {
  union {
    RadixSmem radix;                 // the whole-row path
    uint64_t sorted[kMaxSmemCand];   // the candidates
  };
  uint32_t offset[kRowThreads];
  uint32_t scan[32];
};

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    rlkernel_sample_select(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, int splits,
                           float inv_t, const uint64_t* __restrict__ cand, const uint32_t* __restrict__ counts,
                           bool argmax, int64_t top_k, double top_p, PhiloxArgs rng, int64_t* ids,
                           int32_t* first_bad) {
  __shared__ SelectSmem sm;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // launched as a programmatic dependent of the candidates grid (Hopper+): from here on its writes are visible
  cudaGridDependencySynchronize();
#endif
  const int64_t row = blockIdx.x;
  const FilterArgs args{vocab, row, argmax, argmax ? 1 : top_k, top_p,
                        argmax ? RngSeedOffset{0, 0} : unpack(rng), ids, first_bad};
  // splits <= kRowThreads (the launcher checks): one thread per chunk
  const uint32_t c = threadIdx.x < splits ? counts[row * splits + threadIdx.x] : 0u;
  const int overflow = __syncthreads_or(c > kCandCap);
  uint32_t total;
  const uint32_t before = block_exclusive_scan<kRowThreads>(c, sm.scan, &total);
  if (overflow || total > kMaxSmemCand) {
    filter_and_draw<kRowThreads>(RowSource<T, kRowThreads>{logits + row * row_stride, vocab, inv_t}, args,
                                 sm.radix);
    return;
  }
  if (threadIdx.x < splits) sm.offset[threadIdx.x] = before;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int s = warp; s < splits; s += kRowThreads / 32) {  // one warp copies one chunk's candidates
    const uint64_t* src = cand + (row * splits + s) * kCandCap;
    const uint32_t n = (s + 1 < splits ? sm.offset[s + 1] : total) - sm.offset[s];
    for (uint32_t e = lane; e < n; e += 32) sm.sorted[sm.offset[s] + e] = src[e];
  }
  __syncthreads();
  // each warp sorts runs of 128 candidates and keeps the best 128 of its runs; then a tree of merges across the
  // warps (through shared memory, two barriers a level) leaves the row's best 128 in warp 0
  constexpr int kWarps = kRowThreads / 32;
  const int runs = (static_cast<int>(total) + kRun - 1) / kRun;  // 1 .. kMaxSmemCand / kRun
  uint64_t v[4], u[4];
  for (int r = warp; r < runs; r += kWarps) {
    load_run(sm.sorted + r * kRun, static_cast<int>(total) - r * kRun, u);
    warp_sort_run(u);
    if (r == warp) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = u[i];
    } else {
      warp_merge_top(v, u);
    }
  }
  for (int live = runs < kWarps ? runs : kWarps; live > 1;) {
    const int half = (live + 1) / 2;
    __syncthreads();  // the previous readers of sm.sorted are done
    if (warp >= half && warp < live) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sm.sorted[(warp - half) * kRun + lane * 4 + i] = v[i];
    }
    __syncthreads();
    if (warp < live - half) {
      load_run(sm.sorted + warp * kRun, kRun, u);
      warp_merge_top(v, u);
    }
    live = half;
  }
  if (warp == 0) finish_sorted(v, static_cast<int>(total), args);
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    rlkernel_sample_rows(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, float inv_t,
                         bool argmax, int64_t top_k, double top_p, PhiloxArgs rng, int64_t* ids,
                         int32_t* first_bad) {
  __shared__ RadixSmem sm;
  const int64_t row = blockIdx.x;
  const FilterArgs args{vocab, row, argmax, top_k, top_p, argmax ? RngSeedOffset{0, 0} : unpack(rng), ids,
                        first_bad};
  filter_and_draw<kRowThreads>(RowSource<T, kRowThreads>{logits + row * row_stride, vocab, inv_t}, args, sm);
}

}  // namespace sampling
}  // namespace rlkernel
