// Building blocks of the fused sampler: order-preserving keys, the Philox counter RNG, Gumbel noise and
// block reductions. Framework-free (no torch include).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "rlkernel/error_record.cuh"
#include "rlkernel/sampling_api.h"

namespace rlkernel {
namespace sampling {

constexpr unsigned kFullMask = 0xffffffffu;
// Key 0 is below every real key (the smallest real key, -inf's, is 0x007fffff): it marks "no element".
constexpr uint32_t kNoKey = 0u;
constexpr uint32_t kNanKey = 0xffffffffu;  // NaN ranks above +inf, as torch.argmax treats it

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Monotone map float -> uint32 (a > b as floats  <=>  key(a) > key(b)); every NaN maps to kNanKey.
__device__ __forceinline__ uint32_t float_key(float s) {
  const uint32_t b = __float_as_uint(s);
  const uint32_t key = b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);  // ~b or b|sign
  return s != s ? kNanKey : key;
}

__device__ __forceinline__ float key_float(uint32_t k) {
  uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

// The scaled logit every stage orders by: x * (1/T) in fp32 (T = 0 orders by x itself).
__device__ __forceinline__ float scaled(float x, float inv_t) { return x * inv_t; }

// ---- Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) ----
struct U32x4 {
  uint32_t x, y, z, w;
};

__device__ __forceinline__ U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    uint32_t hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// The seed and offset of this call, read from device memory when the call was captured into a CUDA graph
// (the generator then advances the offset on each replay), as torch's own random kernels do.
struct RngSeedOffset {
  uint64_t seed, offset;
};

__device__ __forceinline__ RngSeedOffset unpack(const PhiloxArgs& a) {
  if (a.captured) {
    return RngSeedOffset{static_cast<uint64_t>(*a.seed_ptr),
                         static_cast<uint64_t>(*a.offset_ptr) + a.offset_intragraph};
  }
  return RngSeedOffset{a.seed, a.offset};
}

// One uniform in (0, 1) per (call, row, token id): the counter is (id / 4, row, offset), the word id % 4.
// Every stage that draws uses this, so the fast and the general path give the same ids for the same seed.
__device__ __forceinline__ float uniform_for(RngSeedOffset so, int64_t row, int64_t id) {
  U32x4 c{static_cast<uint32_t>(id >> 2), static_cast<uint32_t>(row),
          static_cast<uint32_t>(so.offset), static_cast<uint32_t>(so.offset >> 32)};
  U32x4 r = philox4x32_10(c, static_cast<uint32_t>(so.seed), static_cast<uint32_t>(so.seed >> 32));
  const int w = static_cast<int>(id & 3);
  const uint32_t u = w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w;  // no local-memory array
  return (static_cast<float>(u >> 8) + 0.5f) * (1.0f / 16777216.0f);  // 24 bits, never 0 or 1
}

// The Gumbel-max race: argmax_i (s_i + G_i), G_i iid Gumbel, draws i with probability softmax(s)_i over the
// kept set, whatever order the kept tokens are visited in. Needs no prefix sum and no normalisation.
__device__ __forceinline__ float race_score(float s, RngSeedOffset so, int64_t row, int64_t id) {
  float u = uniform_for(so, row, id);
  return s - logf(-logf(u));
}

// A (key, id) pair as one integer that orders like (key desc, id asc) when compared descending (ids < 2^31).
__device__ __forceinline__ uint64_t pack_desc(uint32_t key, int64_t id) {
  return (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int64_t unpack_id(uint64_t packed) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(packed));
}

// (score, id) pairs ordered by score, then lower id.
__device__ __forceinline__ bool better(float sa, int64_t ia, float sb, int64_t ib) {
  return sa > sb || (sa == sb && ia < ib);
}

// ---- block reductions (all threads of the block call them; result returned to all) ----
template <int NT>
__device__ __forceinline__ uint32_t block_max_u32(uint32_t v, uint32_t* scratch) {
  v = __reduce_max_sync(kFullMask, v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  uint32_t m = 0;
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) m = max(m, scratch[w]);
  return m;
}

// Best (score, id) of the block; threads without a candidate pass (-inf, INT64_MAX).
template <int NT>
__device__ __forceinline__ int64_t block_best(float s, int64_t id, float* sscratch, int64_t* iscratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float so = __shfl_xor_sync(kFullMask, s, o);
    int64_t io = __shfl_xor_sync(kFullMask, id, o);
    if (better(so, io, s, id)) {
      s = so;
      id = io;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sscratch[warp] = s;
    iscratch[warp] = id;
  }
  __syncthreads();
  float bs = sscratch[0];
  int64_t bi = iscratch[0];
#pragma unroll
  for (int w = 1; w < NT / 32; ++w) {
    if (better(sscratch[w], iscratch[w], bs, bi)) {
      bs = sscratch[w];
      bi = iscratch[w];
    }
  }
  return bi;
}

// Exclusive prefix sum of v over the block, and the block total.
template <int NT>
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* scratch, uint32_t* total) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t n = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  uint32_t before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) {
    uint32_t t = scratch[w];
    before += (w < warp) ? t : 0u;
    all += t;
  }
  *total = all;
  return before + inc - v;
}

}  // namespace sampling
}  // namespace rlkernel
