// The exact law, on one row, by one block: p = softmax(s), s = logits / T; keep the top_k (ties: lower id);
// keep the smallest prefix, in that order, whose mass reaches top_p; draw from the kept set by a Gumbel race.
// Written over an element source (the whole row from global memory); the fast path's finish_sorted
// (sampling_kernels.cuh) is the same law on sorted candidates.
#pragma once

#include "rlkernel/sampling_radix.cuh"

namespace rlkernel {
namespace sampling {

// Every element of one row, read from global memory (strided over the block).
template <typename T, int NT>
struct RowSource {
  const T* p;
  int64_t vocab;
  float inv_t;
  template <class F>
  __device__ __forceinline__ void visit(F&& f) const {
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < vocab; i += NT) f(float_key(scaled(to_float(__ldg(p + i)), inv_t)), i);
  }
};

template <int NT>
__device__ __forceinline__ uint64_t block_reduce_u64(uint64_t v, bool is_max, uint64_t* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t n = __shfl_xor_sync(kFullMask, v, o);
    v = is_max ? (n > v ? n : v) : v + n;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  uint64_t r = scratch[0];
#pragma unroll
  for (int w = 1; w < NT / 32; ++w) r = is_max ? (scratch[w] > r ? scratch[w] : r) : r + scratch[w];
  return r;
}

struct FilterArgs {
  int64_t vocab, row;
  bool argmax;  // temperature 0
  int64_t top_k;
  double top_p;
  RngSeedOffset rng;
  int64_t* ids;
  ErrorSink errors;
};

__device__ __forceinline__ void mark_bad_row(const FilterArgs& a) {  // one thread per row
  a.ids[a.row] = -1;
  report_error(a.errors, a.row, -1);
}

// top-p in 2^-40 fixed point over the top-k set's mass z: a token is kept while the mass before it is < target
// (also the fast path's cut: finish_sorted, sampling_kernels.cuh)
__device__ __forceinline__ uint64_t top_p_target(double top_p, uint64_t z) {
  const uint64_t target = static_cast<uint64_t>(ceil(top_p * static_cast<double>(z)));
  return min(max(target, uint64_t{1}), z);
}

template <int NT, class Src>
__device__ void filter_and_draw(const Src& src, const FilterArgs& a, RadixSmem& sm) {
  // 1. the row's largest key, whether it has a NaN, and (for T = 0) the first maximal id
  uint32_t mx = 0, nan = 0;
  uint64_t best = 0;  // (key << 32) | ~id: the max is the largest key, then the lowest id
  src.visit([&](uint32_t key, int64_t id) {
    mx = max(mx, key);
    nan |= key == kNanKey;
    const uint64_t pk = pack_desc(key, id);
    best = pk > best ? pk : best;
  });
  if (a.argmax) {
    best = block_reduce_u64<NT>(best, true, sm.u64);
    if (threadIdx.x == 0) {
      const uint32_t top = static_cast<uint32_t>(best >> 32);
      // a NaN (the largest key) or no logit above -inf: no distribution at T = 0 either (contracts, section 1)
      if (top == kNanKey || top <= float_key(__uint_as_float(0xff800000u))) {
        mark_bad_row(a);
      } else {
        a.ids[a.row] = unpack_id(best);
      }
    }
    return;
  }
  mx = block_max_u32<NT>(mx, sm.u32);
  nan = block_max_u32<NT>(nan, sm.u32);
  const float s_max = key_float(mx);
  if (nan || isinf(s_max)) {  // softmax has no value: no distribution to draw from
    if (threadIdx.x == 0) mark_bad_row(a);
    return;
  }
  const int id_bits = bits_for(a.vocab);
  const uint32_t id_max = id_bits >= 32 ? 0xffffffffu : (1u << id_bits) - 1u;
  auto by_key = [](uint32_t key, int64_t) { return key; };
  auto by_low_id = [id_max](uint32_t, int64_t id) { return id_max - static_cast<uint32_t>(id); };

  // 2. top-k: the k-th largest key; among ties at it, the lowest ids
  const bool k_on = a.top_k > 0 && a.top_k < a.vocab;
  uint32_t t_k = 0, cut_k = id_max;
  if (k_on) {
    auto all = [](uint32_t, int64_t) { return true; };
    const SelectResult r = radix_select<NT, false>(src, all, by_key, 32, a.top_k, s_max, sm);
    t_k = r.value;
    const uint64_t take = a.top_k - r.above;
    if (r.equal > take) {
      auto tied = [t_k](uint32_t key, int64_t) { return key == t_k; };
      cut_k = id_max - radix_select<NT, false>(src, tied, by_low_id, id_bits, take, s_max, sm).value;
    }
  }
  auto kept_k = [=](uint32_t key, int64_t id) {
    return !k_on || key > t_k || (key == t_k && static_cast<uint32_t>(id) <= cut_k);
  };

  // 3. top-p over the top-k set, renormalised: keep token j while the mass before it is < top_p * Z
  const bool p_on = a.top_p < 1.0;
  uint32_t t_p = 0, cut_p = id_max;
  if (p_on) {
    uint64_t z = 0;
    src.visit([&](uint32_t key, int64_t id) {
      if (kept_k(key, id)) z += fixed_weight(key, s_max);
    });
    z = block_reduce_u64<NT>(z, false, sm.u64);
    const uint64_t target = top_p_target(a.top_p, z);
    const SelectResult r = radix_select<NT, true>(src, kept_k, by_key, 32, target, s_max, sm);
    t_p = r.value;
    const uint64_t w_t = fixed_weight(t_p, s_max);
    // tied tokens weigh the same: the i-th of them (in id order) is kept while above + i * w_t < target
    uint64_t take = w_t ? (target - r.above + w_t - 1) / w_t : r.equal;
    take = min(max(take, uint64_t{1}), static_cast<uint64_t>(r.equal));
    if (r.equal > take) {
      auto tied = [=](uint32_t key, int64_t id) { return key == t_p && kept_k(key, id); };
      cut_p = id_max - radix_select<NT, false>(src, tied, by_low_id, id_bits, take, s_max, sm).value;
    }
  }

  // 4. the draw: a Gumbel race over the kept set
  float bs = -INFINITY;
  int64_t bi = INT64_MAX;
  src.visit([&](uint32_t key, int64_t id) {
    if (!kept_k(key, id)) return;
    if (p_on && !(key > t_p || (key == t_p && static_cast<uint32_t>(id) <= cut_p))) return;
    const float sc = race_score(key_float(key), a.rng, a.row, id);
    if (better(sc, id, bs, bi)) {
      bs = sc;
      bi = id;
    }
  });
  bi = block_best<NT>(bs, bi, sm.f32, sm.i64);
  if (threadIdx.x == 0) a.ids[a.row] = bi;
}

}  // namespace sampling
}  // namespace rlkernel
