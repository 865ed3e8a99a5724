// Fused log-prob kernels (forward with optional entropy, backward), framework-free: raw pointers, sizes, strides.
//
// Forward, per row of V logits (one team of row_team_threads(V) threads, one pass over the row, see
// row_reduce.cuh): logp = log_softmax(x / T)[id], entropy of softmax(x / T), and the saved stats (r, log2 s)
// from which the backward recomputes every probability without another reduction.
// Rows: id == ignore_index -> logp 0, entropy 0, stats (0, 0), the row is not read; id outside [0, V) -> NaN
// everywhere, the row is not read, and the row and its id go to the device's error record (error_record.cuh;
// no memset, no read-back: rlkernel.check_errors reads it when the caller synchronises).
// Backward: grad_x = (1/T) [g_l (onehot - p) - g_H p (log p + H)]; one read of the row, one write of the gradient
// (grad may alias the logits: each element is read and then written by the same thread).
#pragma once

#include "rlkernel/error_record.cuh"
#include "rlkernel/row_reduce.cuh"

namespace rlkernel {

// Stores the VEC elements of v at element e0 of `row`, skipping those at or past V; one 16-byte store when the
// row start is aligned and the vector is whole.
template <typename T>
__device__ __forceinline__ void store_vec(T* __restrict__ row, int e0, int V, bool aligned, const RawVec& v) {
  constexpr int VEC = ElemTraits<T>::kVec;
  if (aligned && e0 + VEC <= V) {
    __stcs(reinterpret_cast<uint4*>(row + e0), v.u4);
    return;
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    if (e0 + i < V) {
      if constexpr (sizeof(T) == 4) {
        reinterpret_cast<unsigned int*>(row)[e0 + i] = v.u32[i];
      } else {
        reinterpret_cast<unsigned short*>(row)[e0 + i] = v.u16[i];
      }
    }
  }
}

// Packs VEC floats into a raw vector of T (round to nearest even).
template <typename T> __device__ __forceinline__ void pack_vec(RawVec& v, const float* f) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v.u32[i] = __float_as_uint(f[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      v.u32[i] = *reinterpret_cast<uint32_t*>(&h);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      v.u32[i] = *reinterpret_cast<uint32_t*>(&h);
    }
  }
}

template <typename T> __device__ __forceinline__ RawVec fill_vec(float value) {
  float f[ElemTraits<T>::kVec];
#pragma unroll
  for (int i = 0; i < ElemTraits<T>::kVec; ++i) f[i] = value;
  RawVec v;
  pack_vec<T>(v, f);
  return v;
}

struct LogpFwdParams {
  const void* logits;
  long long row_stride;  // elements
  const long long* ids;  // [N], contiguous
  long long n_rows;
  int vocab;
  float c;  // log2(e) / T
  long long ignore_index;
  float* logp;             // [N]
  float* entropy;          // [N], or unused without ENTROPY
  float2* stats;           // [N]: (r, log2 s)
  ErrorSink errors;        // where a bad id is reported
};

template <typename T, int TEAM, bool ENTROPY>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_logp_fwd_kernel(const LogpFwdParams p) {
  __shared__ TeamSmem smem;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  const bool in_range = row < p.n_rows;
  const long long id = in_range ? p.ids[row] : p.ignore_index;
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab);
  const bool active = in_range && !ignored && !bad;
  const bool leader = threadIdx.x % TEAM == 0;
  const T* row_ptr = static_cast<const T*>(p.logits) + (in_range ? row * p.row_stride : 0);
  // The target's logit is fetched first so its latency hides under the row's loads.
  const float x_t = (active && leader) ? ElemTraits<T>::to_float(row_ptr[id]) : 0.0f;
  const RowState st = team_row_state<T, TEAM, ENTROPY>(row_ptr, p.vocab, p.c, active, smem);
  if (!(in_range && leader)) return;
  if (active) {
    const RowResult r = finish_row<ENTROPY>(st);
    p.logp[row] = target_logp(x_t, p.c, r);
    if (ENTROPY) p.entropy[row] = r.entropy;
    p.stats[row] = make_float2(r.ref, r.log2s);
  } else if (ignored) {
    p.logp[row] = 0.0f;
    if (ENTROPY) p.entropy[row] = 0.0f;
    p.stats[row] = make_float2(0.0f, 0.0f);
  } else {
    p.logp[row] = NAN;
    if (ENTROPY) p.entropy[row] = NAN;
    p.stats[row] = make_float2(NAN, NAN);
    report_error(p.errors, row, id);
  }
}

struct LogpBwdParams {
  const void* logits;
  long long row_stride;
  void* grad;  // may equal logits (in place)
  long long grad_row_stride;
  const long long* ids;
  long long n_rows;
  int vocab;
  float c;      // log2(e) / T
  float inv_t;  // 1 / T
  long long ignore_index;
  const float* grad_logp;  // [N] with stride, or nullptr (no gradient reaches logp)
  long long grad_logp_stride;
  const float* grad_entropy;  // [N] with stride (used with HAS_GH)
  long long grad_entropy_stride;
  const float* entropy;  // [N] forward entropy (used with HAS_GH)
  const float2* stats;   // [N] from the forward
};

template <typename T, int TEAM, bool HAS_GH>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_logp_bwd_kernel(const LogpBwdParams p) {
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  if (row >= p.n_rows) return;  // no barrier in the backward: a team without a row just leaves
  const int tid = threadIdx.x % TEAM;
  const long long id = p.ids[row];
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab);
  const T* x_row = static_cast<const T*>(p.logits) + row * p.row_stride;
  T* g_row = static_cast<T*>(p.grad) + row * p.grad_row_stride;
  const bool x_aligned = (reinterpret_cast<uintptr_t>(x_row) & 15u) == 0;
  const bool g_aligned = (reinterpret_cast<uintptr_t>(g_row) & 15u) == 0;
  const int V = p.vocab;
  if (ignored || bad) {  // zero gradient for ignored rows, NaN for a bad id; the row is not read
    const RawVec fill = fill_vec<T>(ignored ? 0.0f : NAN);
    for (int base = 0; base < V; base += CHUNK)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e0 = base + (u * TEAM + tid) * VEC;
        if (e0 < V) store_vec<T>(g_row, e0, V, g_aligned, fill);
      }
    return;
  }
  const float2 st = p.stats[row];
  const float gl = p.grad_logp ? p.grad_logp[row * p.grad_logp_stride] : 0.0f;
  const float gh = HAS_GH ? p.grad_entropy[row * p.grad_entropy_stride] : 0.0f;
  const float H = HAS_GH ? p.entropy[row] : 0.0f;
  // grad = p * (A + B * log2 p) + onehot * gl / T, from g_l (onehot - p) - g_H p (ln2 log2 p + H), over T.
  const float A = -(gl + gh * H) * p.inv_t;
  const float B = -gh * kLn2 * p.inv_t;
  const float G = gl * p.inv_t;
  const int target = static_cast<int>(id);
  for (int base = 0; base < V; base += CHUNK) {
    RawVec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      v[u] = e0 < V ? load_vec<T>(x_row, e0, V, x_aligned) : neg_inf_vec<T>();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      float f[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float lp = fmaf(raw_elem<T>(v[u], i), p.c, -st.x) - st.y;  // log2 p
        const float pr = fast_exp2(lp);
        // p = 0 (a -inf logit) gives 0 * finite: the clamp keeps B * log2 p finite.
        f[i] = HAS_GH ? pr * fmaf(B, fmaxf(lp, kExpFloor), A) : pr * A;
      }
      if (static_cast<unsigned>(target - e0) < static_cast<unsigned>(VEC)) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (e0 + i == target) f[i] += G;
      }
      pack_vec<T>(v[u], f);
      if (e0 < V) store_vec<T>(g_row, e0, V, g_aligned, v[u]);
    }
  }
}

}  // namespace rlkernel
