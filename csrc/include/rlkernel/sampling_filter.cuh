// The exact law, on one row, by one block: p = softmax(s), s = logits / T; keep the top_k (ties: lower id);
// keep the smallest prefix, in that order, whose mass reaches top_p; keep of those the tokens with
// s >= s_max + ln(min_p); draw from the kept set by a Gumbel race (or, for the processed log-probs, sum its mass;
// or both in one pass, for the sampler's own processed log-probs). Written over an element source (the whole row
// from global memory); the fast path's finish_sorted (sampling_kernels.cuh) is the same law on sorted candidates.
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
  // the scaled logit of one token, by the expression visit keys (kDrawLogp: the drawn id's)
  __device__ __forceinline__ float scaled_at(int64_t i) const { return scaled(to_float(__ldg(p + i)), inv_t); }
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

// One row's settings, read from SampleSettings (its per-row values where given). bad: the code of the first
// argument out of range (kArg*), -1 when none. argmax rows: inv_t 1, top_k 1, no noise.
struct RowSettings {
  bool argmax;
  float inv_t;
  int64_t top_k;     // 0: all (also for top_k >= vocab)
  double top_p;
  float log_min_p;   // ln(min_p), -inf for min_p = 0: a token is kept iff s >= s_max + log_min_p
  int bad;
};

__device__ __forceinline__ RowSettings row_settings(const SampleSettings& s, int64_t row, int64_t vocab) {
  const float t = s.temperature_rows ? s.temperature_rows[row] : s.temperature;
  const int64_t k = s.top_k_rows ? s.top_k_rows[row] : s.top_k;
  const double p = s.top_p_rows ? static_cast<double>(s.top_p_rows[row]) : s.top_p;
  const float mp = s.min_p_rows ? s.min_p_rows[row] : s.min_p;
  RowSettings r;
  r.bad = !(t >= 0.f && t <= 3.402823466e38f) ? kArgTemperature
          : k < 0                              ? kArgTopK
          : !(p > 0.0 && p <= 1.0)             ? kArgTopP
          : !(mp >= 0.f && mp <= 1.f)          ? kArgMinP
                                               : -1;
  r.argmax = t == 0.f;
  r.inv_t = r.argmax ? 1.f : 1.f / t;
  r.top_k = r.argmax ? 1 : (k >= vocab ? 0 : k);
  r.top_p = r.argmax ? 1.0 : p;
  r.log_min_p = mp > 0.f ? logf(mp) : -INFINITY;
  return r;
}

// The noise of one row: the generator's (counter word 1 = the row) or the row's own seed and offset (word 1 = 0).
struct RowNoise {
  RngSeedOffset rng;
  uint32_t word;
};

__device__ __forceinline__ RowNoise row_noise(const SampleSettings& s, int64_t row) {
  if (s.seeded) {
    const int64_t seed = s.seed_rows ? s.seed_rows[row] : s.seed;
    const int64_t offset = s.offset_rows ? s.offset_rows[row] : s.offset;
    return RowNoise{RngSeedOffset{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset)}, 0u};
  }
  return RowNoise{unpack(s.generator), static_cast<uint32_t>(row)};
}

// What a kernel does with each row's kept set (the kernels' template argument kMode): draw an id (kDraw); sum the
// kept set's masses for the processed log-prob forward (kStats: rlkernel.logp with filters); or both in one pass
// (kDrawLogp: rlkernel.sample(..., return_logprobs="processed")): draw an id and write its processed log-prob from
// the kept set's mass, summed by the same integer code as kStats sums it (fixed_weight, any order: the same bits),
// so the sampler's log-prob is the logp forward's for that id bit for bit, with no second pass over the logits.
// kDrawLogpRaw (rlkernel.sample(..., return_logprobs=True)): draw as kDraw does, then write the drawn id's unfiltered
// log-prob from the row's max and sum of exponentials (sampling_kernels.cuh, "raw log-probs"); the law itself runs
// in kDraw (law_mode), so the ids are kDraw's.
constexpr int kDraw = 0, kStats = 1, kDrawLogp = 2, kDrawLogpRaw = 3;
// What the law's code (filter_and_draw, finish_sorted) runs for a kernel's mode, and whether the kernel writes a
// log-prob per drawn id (a row without a distribution or with a bad setting: NaN, mark_bad_row / row_prologue).
__host__ __device__ constexpr int law_mode(int mode) { return mode == kDrawLogpRaw ? kDraw : mode; }
__host__ __device__ constexpr bool draws_logp(int mode) { return mode == kDrawLogp || mode == kDrawLogpRaw; }

struct FilterArgs {
  int64_t vocab, row;
  bool argmax;  // temperature 0
  int64_t top_k;
  double top_p;
  float log_min_p;
  RowNoise noise;
  int64_t* ids;  // draw modes: where the id goes
  float* logp;   // draws_logp modes: where the drawn id's log-prob goes (nullptr in the other modes)
  ErrorSink errors;
};

__device__ __forceinline__ FilterArgs filter_args(const RowSettings& r, const SampleSettings& s, int64_t vocab,
                                                  int64_t row, bool draws, int64_t* ids, float* logp,
                                                  const ErrorSink& errors) {
  return FilterArgs{vocab, row, r.argmax, r.top_k, r.top_p, r.log_min_p,
                    draws && !r.argmax ? row_noise(s, row) : RowNoise{RngSeedOffset{0, 0}, 0u}, ids, logp, errors};
}

// The row's kept set as the processed log-probs need it (thread 0's copy is the valid one): ok false for a row
// without a distribution; mass = sum of fixed_weight over the kept set, dmass = sum of fixed_weight * (s_max - s),
// both in 2^-40 fixed point (integer sums: the same bits in whatever order they are added); threshold = the smallest
// pack_desc(key, id) of the kept set.
struct KeptStats {
  bool ok;
  float s_max;
  uint64_t mass, dmass, threshold;
};

__device__ __forceinline__ void mark_bad_row(const FilterArgs& a) {  // one thread per row
  a.ids[a.row] = -1;
  if (a.logp) a.logp[a.row] = NAN;  // kDrawLogp: no distribution, no log-prob (what kStats writes for it)
  report_error(a.errors, a.row, -1);
}

// log S, S = the kept set's mass (fixed point, 2^-40 units: S >= 1, the top token is always kept with weight
// exactly 1), in the units of s; 0 at T = 0. The processed log-prob of a kept token of scaled logit s is then
// kept_logp(s, s_max, float(log S)): stats mode's write_processed and the draw's log-prob (kDrawLogp) both
// take these two, so they agree bit for bit.
__device__ __forceinline__ double log_kept_mass(uint64_t mass, bool argmax) {
  return argmax ? 0.0 : log(static_cast<double>(mass)) - 40.0 * 0.6931471805599453;
}
__device__ __forceinline__ float kept_logp(float s, float s_max, float log_s) { return (s - s_max) - log_s; }

// kDrawLogp (thread 0): the drawn id's processed log-prob; s its scaled logit, mass the kept set's.
__device__ __forceinline__ void write_drawn_logp(const FilterArgs& a, float s, float s_max, uint64_t mass) {
  a.logp[a.row] = kept_logp(s, s_max, static_cast<float>(log_kept_mass(mass, a.argmax)));
}

// A per-row setting out of range: id -1 and a kErrOpBadArg entry with the argument's code (one thread per row).
__device__ __forceinline__ void report_bad_arg(const ErrorSink& errors, int64_t row, int code) {
  ErrorSink s = errors;
  s.op = kErrOpBadArg;
  report_error(s, row, code);
}

// min_p's cut on the scaled logit (float, the same expression on every path)
__device__ __forceinline__ float min_p_floor(float s_max, float log_min_p) { return s_max + log_min_p; }

// fixed_weight(key) * (s_max - s) in 2^-40 fixed point (0 for a token of weight 0: -inf times 0 is no number)
__device__ __forceinline__ uint64_t fixed_dweight(uint32_t key, float s_max) {
  const float s = key_float(key);
  const float w = __expf(s - s_max);
  const float d = s_max - s;
  return w > 0.f ? __float2ull_rn(w * d * 1099511627776.0f) : 0ull;
}

// top-p in 2^-40 fixed point over the top-k set's mass z: a token is kept while the mass before it is < target
// (also the fast path's cut: finish_sorted, sampling_kernels.cuh)
__device__ __forceinline__ uint64_t top_p_target(double top_p, uint64_t z) {
  const uint64_t target = static_cast<uint64_t>(ceil(top_p * static_cast<double>(z)));
  return min(max(target, uint64_t{1}), z);
}

// The exact law on one row. kDraw: writes the drawn id (or -1 and an error entry). kStats: returns the kept set's
// KeptStats to thread 0 and writes nothing. kDrawLogp: as kDraw, and the drawn id's processed log-prob (NaN for a
// row without a distribution), the kept set's mass summed in the draw's own visit of the row.
template <int NT, int kMode, class Src>
__device__ KeptStats filter_and_draw(const Src& src, const FilterArgs& a, RadixSmem& sm) {
  KeptStats out{false, 0.f, 0, 0, 0};
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
      const bool bad = top == kNanKey || top <= float_key(__uint_as_float(0xff800000u));
      if (kMode == kStats) {
        out = KeptStats{!bad, key_float(top), uint64_t{1} << 40, 0, best};
      } else if (bad) {
        mark_bad_row(a);
      } else {
        a.ids[a.row] = unpack_id(best);
        // the argmax's scaled logit is s_max itself (1/T = 1): (s - s_max) - 0, as write_processed computes it
        if (kMode == kDrawLogp) write_drawn_logp(a, key_float(top), key_float(top), uint64_t{1} << 40);
      }
    }
    return out;
  }
  mx = block_max_u32<NT>(mx, sm.u32);
  nan = block_max_u32<NT>(nan, sm.u32);
  const float s_max = key_float(mx);
  if (nan || isinf(s_max)) {  // softmax has no value: no distribution to draw from
    if (kMode != kStats && threadIdx.x == 0) mark_bad_row(a);
    return out;
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
  // 4. min_p (after top-k and top-p): s >= s_max + ln(min_p)
  const float s_floor = min_p_floor(s_max, a.log_min_p);
  auto kept = [=](uint32_t key, int64_t id) {
    if (!kept_k(key, id)) return false;
    if (p_on && !(key > t_p || (key == t_p && static_cast<uint32_t>(id) <= cut_p))) return false;
    return key_float(key) >= s_floor;
  };

  if (kMode == kStats) {  // 5s. the kept set's masses and its last element, in integers
    uint64_t mass = 0, dmass = 0, low = 0;  // low: the largest ~pack_desc, i.e. the smallest kept pack_desc
    src.visit([&](uint32_t key, int64_t id) {
      if (!kept(key, id)) return;
      mass += fixed_weight(key, s_max);
      dmass += fixed_dweight(key, s_max);
      const uint64_t inv = ~pack_desc(key, id);
      low = inv > low ? inv : low;
    });
    mass = block_reduce_u64<NT>(mass, false, sm.u64);
    dmass = block_reduce_u64<NT>(dmass, false, sm.u64);
    low = block_reduce_u64<NT>(low, true, sm.u64);
    return KeptStats{true, s_max, mass, dmass, ~low};
  }

  // 5. the draw: a Gumbel race over the kept set (kDrawLogp: and the kept set's mass, as 5s sums it)
  float bs = -INFINITY;
  int64_t bi = INT64_MAX;
  uint64_t mass = 0;
  src.visit([&](uint32_t key, int64_t id) {
    if (!kept(key, id)) return;
    if (kMode == kDrawLogp) mass += fixed_weight(key, s_max);
    const float sc = race_score(key_float(key), a.noise.rng, a.noise.word, id);
    if (better(sc, id, bs, bi)) {
      bs = sc;
      bi = id;
    }
  });
  bi = block_best<NT>(bs, bi, sm.f32, sm.i64);
  if (kMode == kDrawLogp) mass = block_reduce_u64<NT>(mass, false, sm.u64);
  if (threadIdx.x == 0) {
    a.ids[a.row] = bi;
    if (kMode == kDrawLogp) write_drawn_logp(a, src.scaled_at(bi), s_max, mass);
  }
  return out;
}

}  // namespace sampling
}  // namespace rlkernel
