// Framework-free row reduction shared by the log-prob kernels and the sampler.
//
// A row of V logits x (bf16, fp16 or fp32, last dim contiguous, any start alignment) is reduced to the
// online-softmax state of z = x / T in base-2 units, y = x * c with c = log2(e) / T:
//   m = max_i y_i, s = sum_i 2^(y_i - r), t = sum_i 2^(y_i - r) * (y_i - r), with r = m (or 0 when m = -inf),
// from which log2-sum-exp = r + log2(s), and the entropy in nats is ln2 * (log2(s) - t / s).
// Each term of t is <= 0, so the entropy is a sum of non-negative parts (no cancellation).
//
// The reduction order of a row depends only on (V, element type): it is fixed by the team size
// row_team_threads(V, sizeof(T)), the chunk shape and the tree below, never by N, by which CTA runs the row, or
// by the row's address. Order, exactly:
//   1. The row is cut into chunks of kChunkElems(T) = TEAM * kUnroll * VEC elements. In chunk k, thread j of the
//      team owns the vectors u = 0..kUnroll-1 at elements k*chunk + (u*TEAM + j)*VEC .. +VEC-1 (VEC = 16 bytes).
//      Elements >= V read as -inf (they add exact zeros).
//   2. Per chunk the thread takes the NaN-propagating max of its kUnroll*VEC elements, rescales (s, t) to the
//      new max, then adds, for u = 0..kUnroll-1, the pairwise tree of that vector's VEC terms.
//   3. The TEAM per-thread states are merged by a butterfly over lanes (xor 16, 8, 4, 2, 1), then the team's
//      warps' states, in warp order, by the same butterfly in the team's first warp.
// A row whose start is not 16-byte aligned is loaded element by element into the same registers: same order,
// same bits. Callers: every thread of a CTA of kCtaThreads threads calls team_row_state() (it has
// __syncthreads when TEAM > 32); CTA_THREADS / TEAM rows run side by side.
#pragma once

#include <cstdint>
#include <cfloat>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

namespace rlkernel {

constexpr int kCtaThreads = 512;  // one CTA shape for every V: 2 CTAs/SM at <= 64 registers per thread
constexpr int kUnroll = 8;        // 16-byte loads in flight per thread before the first use (128 B)
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2e = 1.4426950408889634f;
// ex2.approx.ftz returns 0 below -126; clamping d to this keeps 0 * d finite for d = -inf.
constexpr float kExpFloor = -256.0f;

// Team size for a row: the power of two in [32, kCtaThreads] whose one chunk is the first to cover V
// (a function of V and the element size only: this is what makes the reduction order independent of N).
__host__ __device__ constexpr int row_team_threads(long long V, int elem_bytes) {
  const long long per_thread = static_cast<long long>(kUnroll) * (16 / elem_bytes);
  int team = 32;
  while (team < kCtaThreads && static_cast<long long>(team) * per_thread < V) team *= 2;
  return team;
}

template <typename T> struct ElemTraits;
template <> struct ElemTraits<float> {
  static constexpr int kVec = 4;
  static constexpr uint32_t kNegInfBits = 0xFF800000u;
  __device__ static float to_float(float v) { return v; }
};
template <> struct ElemTraits<__nv_bfloat16> {
  static constexpr int kVec = 8;
  static constexpr uint16_t kNegInfBits = 0xFF80u;
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct ElemTraits<__half> {
  static constexpr int kVec = 8;
  static constexpr uint16_t kNegInfBits = 0xFC00u;
  __device__ static float to_float(__half v) { return __half2float(v); }
};

__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 16-byte vector: VEC elements of T, as raw bits, so loads, -inf fill and stores need no conversion.
union RawVec {
  uint4 u4;
  uint32_t u32[4];
  uint16_t u16[8];
};

// Element i of a raw vector as float.
template <typename T> __device__ __forceinline__ float raw_elem(const RawVec& v, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(v.u32[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(static_cast<uint32_t>(v.u16[i]) << 16);
  } else {
    return __half2float(__ushort_as_half(v.u16[i]));
  }
}

// Loads the VEC elements starting at element e0 of `row`; elements at or past V read as -inf. `aligned`
// (row start 16-byte aligned) picks one 16-byte load; otherwise element loads fill the same registers.
template <typename T>
__device__ __forceinline__ RawVec load_vec(const T* __restrict__ row, int e0, int V, bool aligned) {
  constexpr int VEC = ElemTraits<T>::kVec;
  RawVec v;
  if (aligned && e0 + VEC <= V) {
    v.u4 = __ldcs(reinterpret_cast<const uint4*>(row + e0));
    return v;
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const bool ok = e0 + i < V;
    if constexpr (sizeof(T) == 4) {
      v.u32[i] = ok ? __ldcs(reinterpret_cast<const unsigned int*>(row) + e0 + i) : ElemTraits<T>::kNegInfBits;
    } else {
      v.u16[i] = ok ? __ldcs(reinterpret_cast<const unsigned short*>(row) + e0 + i) : ElemTraits<T>::kNegInfBits;
    }
  }
  return v;
}

template <typename T> __device__ __forceinline__ RawVec neg_inf_vec() {
  RawVec v;
  constexpr uint32_t bits = sizeof(T) == 4 ? ElemTraits<T>::kNegInfBits
                                           : (uint32_t{ElemTraits<T>::kNegInfBits} * 0x10001u);
  v.u4 = make_uint4(bits, bits, bits, bits);
  return v;
}

// NaN-propagating max of the elements of `n` raw vectors (packed for 16-bit types).
template <typename T, int n> __device__ __forceinline__ float raw_max(const RawVec (&v)[n]) {
  if constexpr (sizeof(T) == 4) {
    float m = -INFINITY;
#pragma unroll
    for (int u = 0; u < n; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) m = max_nan(m, __uint_as_float(v[u].u32[i]));
    return m;
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    T2 m = *reinterpret_cast<const T2*>(&v[0].u32[0]);
#pragma unroll
    for (int u = 0; u < n; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) m = __hmax2_nan(m, *reinterpret_cast<const T2*>(&v[u].u32[i]));
    return max_nan(ElemTraits<T>::to_float(m.x), ElemTraits<T>::to_float(m.y));
  }
}

// Online-softmax state of part of a row, base-2 units (see the top of this file).
struct RowState {
  float m;  // running max of y (-inf when empty, NaN when a NaN was seen)
  float s;  // sum of 2^(y - ref(m))
  float t;  // sum of 2^(y - ref(m)) * (y - ref(m)); only with entropy
};

__device__ __forceinline__ float state_ref(float m) { return m == -INFINITY ? 0.0f : m; }

__device__ __forceinline__ RowState empty_state() { return RowState{-INFINITY, 0.0f, 0.0f}; }

// Merge of two states; symmetric in its arguments (bitwise), so butterfly lanes agree.
template <bool ENTROPY> __device__ __forceinline__ RowState merge_state(const RowState& a, const RowState& b) {
  RowState o;
  o.m = max_nan(a.m, b.m);
  const float r = state_ref(o.m);
  // m = -inf gives da = -FLT_MAX: the scale is 0 and da * s = -FLT_MAX * 0 = 0, no NaN from an empty part.
  const float da = fmaxf(a.m - r, -FLT_MAX), db = fmaxf(b.m - r, -FLT_MAX);
  const float ea = fast_exp2(da), eb = fast_exp2(db);
  // _rn intrinsics: no fma contraction, so merge(a, b) and merge(b, a) round alike and every lane agrees.
  o.s = __fadd_rn(__fmul_rn(ea, a.s), __fmul_rn(eb, b.s));
  o.t = ENTROPY ? __fadd_rn(__fmul_rn(ea, fmaf(da, a.s, a.t)), __fmul_rn(eb, fmaf(db, b.s, b.t))) : 0.0f;
  return o;
}

// Adds one chunk (n raw vectors) to a thread's state: rescale to the chunk's new max, then per vector a
// pairwise tree of its VEC terms.
template <typename T, bool ENTROPY, int n>
__device__ __forceinline__ void add_chunk(RowState& st, const RawVec (&v)[n], float c) {
  constexpr int VEC = ElemTraits<T>::kVec;
  const float m_new = max_nan(st.m, raw_max<T, n>(v) * c);
  const float r_new = state_ref(m_new);
  const float delta = fmaxf(st.m - r_new, -FLT_MAX);
  const float scale = fast_exp2(delta);
  st.t = ENTROPY ? scale * fmaf(delta, st.s, st.t) : 0.0f;
  st.s = scale * st.s;
  st.m = m_new;
#pragma unroll
  for (int u = 0; u < n; ++u) {
    float e[VEC], w[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float d = fmaf(raw_elem<T>(v[u], i), c, -r_new);
      e[i] = fast_exp2(d);
      if (ENTROPY) w[i] = e[i] * fmaxf(d, kExpFloor);
    }
#pragma unroll
    for (int w2 = VEC / 2; w2 >= 1; w2 /= 2)
#pragma unroll
      for (int i = 0; i < w2; ++i) {
        e[i] = e[i] + e[i + w2];
        if (ENTROPY) w[i] = w[i] + w[i + w2];
      }
    st.s += e[0];
    if (ENTROPY) st.t += w[0];
  }
}

template <bool ENTROPY> __device__ __forceinline__ RowState warp_merge(RowState st) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    RowState o;
    o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
    o.t = ENTROPY ? __shfl_xor_sync(0xffffffffu, st.t, off) : 0.0f;
    st = merge_state<ENTROPY>(st, o);
  }
  return st;
}

// Shared memory the team reduction needs, per CTA.
struct TeamSmem {
  RowState warp_state[kCtaThreads / 32];
};

// Step 3 of the order above: the team's per-thread states merged (a butterfly over lanes, then the team's warps in
// order in its first warp), to every thread of the team. Every thread of the CTA calls it (it has __syncthreads
// when TEAM > 32). Also the sampler's merge of its per-chunk states (sampling_kernels.cuh, raw log-probs).
template <bool ENTROPY, int TEAM>
__device__ __forceinline__ RowState team_merge(RowState st, TeamSmem& smem) {
  st = warp_merge<ENTROPY>(st);
  if constexpr (TEAM > 32) {
    constexpr int W = TEAM / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // the previous row's readers are done with warp_state
    if (lane == 0) smem.warp_state[warp] = st;
    __syncthreads();
    const int first = (threadIdx.x / TEAM) * W;
    st = lane < W ? smem.warp_state[first + lane] : empty_state();
    st = warp_merge<ENTROPY>(st);
  }
  return st;
}

// The state of one row, reduced by a team of TEAM threads (tid = thread index within the team). Every thread of
// the CTA must call it (same V for all: the loop trip counts agree); `active` = false for a team without a row
// (it loads nothing and returns the empty state). Every thread of the team gets the same state, bit for bit.
template <typename T, int TEAM, bool ENTROPY>
__device__ __forceinline__ RowState team_row_state(const T* __restrict__ row, int V, float c, bool active,
                                                   TeamSmem& smem) {
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
  const int tid = threadIdx.x % TEAM;
  RowState st = empty_state();
  if (active) {
    const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
    for (int base = 0; base < V; base += CHUNK) {
      RawVec v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e0 = base + (u * TEAM + tid) * VEC;
        v[u] = e0 < V ? load_vec<T>(row, e0, V, aligned) : neg_inf_vec<T>();
      }
      add_chunk<T, ENTROPY, kUnroll>(st, v, c);
    }
  }
  return team_merge<ENTROPY, TEAM>(st, smem);
}

// Per-row results from a reduced state. lse2 = log2-sum-exp of y = r + log2(s) is kept as (r, log2 s) so the
// backward recomputes 2^(x*c - r - log2 s) without rounding r + log2 s (|r| can be ~1e4, where one float ulp
// would cost 1e-3 in every probability).
struct RowResult {
  float ref;    // r
  float log2s;  // log2(s)
  float entropy;
};

template <bool ENTROPY> __device__ __forceinline__ RowResult finish_row(const RowState& st) {
  RowResult r;
  r.ref = state_ref(st.m);
  r.log2s = log2f(st.s);  // s = 0 (all -inf) -> -inf; NaN stays NaN
  r.entropy = ENTROPY ? kLn2 * (r.log2s - st.t / st.s) : 0.0f;  // all -inf: -inf - 0/0 = NaN (contract)
  return r;
}

// log p(target) in nats from the target's logit: ln2 * (x_t * c - r - log2 s); fma keeps x_t*c - r exact
// before its one rounding. All -inf row: -inf - (-inf) = NaN.
__device__ __forceinline__ float target_logp(float x_t, float c, const RowResult& r) {
  return kLn2 * (fmaf(x_t, c, -r.ref) - r.log2s);
}

}  // namespace rlkernel
