// Block-wide radix selection over a set of (key, id) elements, without sorting: 11-bit digits, a shared
// histogram per pass, one warp finding the digit where the running total (from the top) crosses a target.
// Counts select "the r-th largest"; fixed-point masses select "where the prefix mass reaches P". Integer
// arithmetic throughout, so the result does not depend on the order threads add in (reproducible draws).
#pragma once

#include "rlkernel/sampling_common.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;

// Token weights exp(s - s_max) in [0, 1] as fixed point with 40 fraction bits: integer sums are exact and
// order-free; a row of up to 2^24 tokens cannot overflow 64 bits. Resolution 2^-40 per token.
__device__ __forceinline__ uint64_t fixed_weight(uint32_t key, float s_max) {
  float w = __expf(key_float(key) - s_max);
  return __float2ull_rn(w * 1099511627776.0f);  // * 2^40 (exact scaling)
}

struct RadixSmem {
  uint32_t count[kBins];
  uint64_t mass[kBins];
  uint32_t digit;
  uint64_t above;
  uint32_t u32[32];
  uint64_t u64[32];
  float f32[32];
  int64_t i64[32];
};

// Warp 0: the first bin from the top whose inclusive running total reaches `need` (>= 1, <= the total).
// Writes the bin to sm.digit and the total of the bins above it to sm.above.
template <typename V>
__device__ __forceinline__ void warp_find_digit(const V* hist, uint64_t need, RadixSmem& sm) {
  const int lane = threadIdx.x % 32;
  constexpr int kPer = kBins / 32;
  const int top = kBins - 1 - lane * kPer;  // lane 0 holds the highest bins
  uint64_t sum = 0;
#pragma unroll 8
  for (int j = 0; j < kPer; ++j) sum += hist[top - j];
  uint64_t inc = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint64_t n = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += n;
  }
  const uint64_t exc = inc - sum;
  const unsigned hit = __ballot_sync(kFullMask, exc < need && inc >= need);
  if (lane == (hit ? __ffs(hit) - 1 : 31)) {  // hit is never 0 when need <= total
    uint64_t acc = exc;
    int d = top - kPer + 1;
    for (int j = 0; j < kPer; ++j) {
      if (acc + hist[top - j] >= need) {
        d = top - j;
        break;
      }
      acc += hist[top - j];
    }
    sm.digit = static_cast<uint32_t>(d);
    sm.above = acc;
  }
}

struct SelectResult {
  uint32_t value;  // the selected value of val(key, id)
  uint64_t above;  // count (or mass) of included elements with a larger value
  uint32_t equal;  // how many included elements have exactly that value
};

// Among elements with include(key, id), ordered by v = val(key, id) (< 2^bits) descending, find the value v*
// of the element where the running total first reaches `need`: the need-th largest when kMass is false, the
// element whose inclusive prefix of fixed_weight(key, s_max) first reaches `need` when kMass is true.
template <int NT, bool kMass, class Src, class Inc, class Val>
__device__ SelectResult radix_select(const Src& src, Inc include, Val val, int bits, uint64_t need, float s_max,
                                     RadixSmem& sm) {
  uint32_t prefix = 0;
  uint64_t above = 0;
  uint32_t equal = 0;
  for (int hi = bits; hi > 0; hi -= kDigitBits) {
    const int lo = hi > kDigitBits ? hi - kDigitBits : 0;
    const uint32_t himask = hi >= 32 ? 0u : ~((1u << hi) - 1u);  // bits already decided
    for (int b = threadIdx.x; b < kBins; b += NT) {
      sm.count[b] = 0;
      if (kMass) sm.mass[b] = 0;
    }
    __syncthreads();
    src.visit([&](uint32_t key, int64_t id) {
      if (!include(key, id)) return;
      const uint32_t v = val(key, id);
      if ((v & himask) != prefix) return;
      const uint32_t d = (v >> lo) & ((1u << (hi - lo)) - 1u);
      atomicAdd(&sm.count[d], 1u);
      if (kMass) atomicAdd(reinterpret_cast<unsigned long long*>(&sm.mass[d]),
                           static_cast<unsigned long long>(fixed_weight(key, s_max)));
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      if (kMass) warp_find_digit(sm.mass, need - above, sm);
      else warp_find_digit(sm.count, need - above, sm);
    }
    __syncthreads();
    prefix |= sm.digit << lo;
    above += sm.above;
    equal = sm.count[sm.digit];
    __syncthreads();  // sm.digit / sm.count are rewritten by the next pass
  }
  return SelectResult{prefix, above, equal};
}

__host__ __device__ __forceinline__ int bits_for(int64_t n) {  // bits to hold values 0 .. n-1
  int b = 1;
  while (b < 32 && (int64_t{1} << b) < n) ++b;
  return b;
}

}  // namespace sampling
}  // namespace rlkernel
