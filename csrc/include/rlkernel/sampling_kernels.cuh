// The fused sampler's kernels.
//  fast path (1 <= top_k <= kMaxFastK, or T = 0):
//    rlkernel_sample_candidates: one block per 4096-token chunk of a row reads it once and keeps a superset of
//      the chunk's top-k: every token >= L, L = the k-th largest of the block's 256 per-thread maxima (at least
//      k tokens are >= L, so the chunk's k-th largest, and every token tied with it, is >= L).
//    rlkernel_sample_select: one block per row stages the candidates of all chunks in shared memory and runs
//      the exact law on them (filter_and_draw). A row whose candidates overflow runs it on the whole row.
//  general path (top_k = 0 or large): rlkernel_sample_rows runs the exact law on each whole row.
#pragma once

#include "rlkernel/sampling_filter.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kCandThreads = 256;
constexpr int kVec = 4;                                   // tokens per vector load
constexpr int kVecsPerThread = 4;                         // 16 tokens per thread
constexpr int kChunk = kCandThreads * kVec * kVecsPerThread;  // 4096 tokens per block
constexpr int kMaxFastK = 128;
constexpr int kCandCap = 4 * kMaxFastK;  // candidates one chunk may keep before its row overflows
constexpr int kRowThreads = 512;
constexpr int kMaxSmemCand = 12288;  // candidates a select block stages (96 KiB)

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
                               float inv_t, int k, uint64_t* __restrict__ cand, uint32_t* __restrict__ counts) {
  __shared__ uint32_t scratch[kCandThreads / 32];
  const int64_t row = blockIdx.x / splits;
  const int split = blockIdx.x % splits;
  const T* p = logits + row * row_stride;
  const int64_t start = static_cast<int64_t>(split) * kChunk;
  const bool aligned = reinterpret_cast<uintptr_t>(p) % (kVec * sizeof(T)) == 0;

  // vector j of thread t covers tokens start + (j * threads + t) * 4 ...: coalesced across the warp
  uint32_t keys[kVecsPerThread * kVec];
  uint32_t tmax = kNoKey;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int64_t base = start + (static_cast<int64_t>(j) * kCandThreads + threadIdx.x) * kVec;
    float x[kVec];
    load4(p, base, vocab, aligned, x);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const uint32_t key = base + i < vocab ? float_key(scaled(x[i], inv_t)) : kNoKey;
      keys[j * kVec + i] = key;
      tmax = max(tmax, key);
    }
  }
  // L = the k-th largest per-thread maximum, bit by bit from the top (0 when fewer than k threads hold tokens)
  uint32_t bound = 0;
  for (int b = 31; b >= 0; --b) {
    const uint32_t c = bound | (1u << b);
    if (__syncthreads_count(tmax >= c) >= k) bound = c;
  }
  bound = max(bound, 1u);  // never keep padding (kNoKey)
  uint32_t mine = 0;
#pragma unroll
  for (int e = 0; e < kVecsPerThread * kVec; ++e) mine += keys[e] >= bound;
  uint32_t total;
  uint32_t pos = block_exclusive_scan<kCandThreads>(mine, scratch, &total);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
  if (total > kCandCap) return;  // the row overflows: its select block reads the whole row
  uint64_t* out = cand + static_cast<int64_t>(blockIdx.x) * kCandCap;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const uint32_t key = keys[j * kVec + i];
      if (key >= bound) {
        const int64_t id = start + (static_cast<int64_t>(j) * kCandThreads + threadIdx.x) * kVec + i;
        out[pos++] = (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(id);
      }
    }
  }
}

struct SelectSmem {
  RadixSmem radix;
  uint32_t offset[kRowThreads + 1];
};

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    rlkernel_sample_select(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, int splits,
                           float inv_t, const uint64_t* __restrict__ cand, const uint32_t* __restrict__ counts,
                           bool argmax, int64_t top_k, double top_p, PhiloxArgs rng, int64_t* ids,
                           int32_t* first_bad) {
  extern __shared__ uint64_t staged[];
  __shared__ SelectSmem sm;
  const int64_t row = blockIdx.x;
  const FilterArgs args{vocab, row, argmax, top_k, top_p, argmax ? RngSeedOffset{0, 0} : unpack(rng), ids,
                        first_bad};
  // splits <= kRowThreads (the launcher checks): one thread per chunk
  const uint32_t c = threadIdx.x < splits ? counts[row * splits + threadIdx.x] : 0u;
  const int overflow = __syncthreads_or(c > kCandCap);
  uint32_t total;
  const uint32_t before = block_exclusive_scan<kRowThreads>(c, sm.radix.u32, &total);
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
    for (uint32_t e = lane; e < n; e += 32) staged[sm.offset[s] + e] = src[e];
  }
  __syncthreads();
  filter_and_draw<kRowThreads>(CandSource<kRowThreads>{staged, static_cast<int>(total)}, args, sm.radix);
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
