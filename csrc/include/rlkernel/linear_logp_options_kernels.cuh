// Kernels of rlkernel.linear_logp's options on the fused path (issue 31): a per-row temperature and the softcap,
// framework-free. Copies of linear_logp_kernels.cuh's fold and grad kernels with those two additions, so the plain
// kernels (and their verified SASS, row_grad.cuh says why that matters) stay as they are: a call without options
// runs none of this.
// - fold_rows: rlkernel_linear_logp_fold_kernel with c = log2(e) / T_row (T_row from a float32 [n_rows] vector; NaN
//   marks a row whose temperature was out of range: NaN results, reported to the error record by the caller).
// - grad_rows: rlkernel_linear_logp_grad_kernel with 1/T_row, and, with a softcap, the tile holding the softcapped
//   logits x = cap tanh(scale z / cap): the gradient times dx/dz = scale (1 - (x / cap)^2). The softcap's factor is
//   compiled for float32 tiles only (the caller keeps softcapped logits in float32, never rounded to 16 bits; in the
//   16-bit instantiations it spilled registers): a 16-bit tile's softcap is ignored here, the launcher refuses it.
// - softcap: x = cap tanh(scale z / cap) over a tile, in place (float math; a float32 tile in practice).
#pragma once

#include "rlkernel/linear_logp_kernels.cuh"

namespace rlkernel {

// log2(e) / t and 1 / t in float32, correctly rounded (in double they spilled registers in grad_rows).
__device__ __forceinline__ float row_log2e_over(float t) { return __fdiv_rn(kLog2e, t); }
__device__ __forceinline__ float row_inverse(float t) { return __frcp_rn(t); }

struct LinearFoldRowsParams {
  LinearFoldParams base;   // p.c unused: each row's c comes from row_t
  const float* row_t;      // [n_rows] temperatures (NaN: a bad row)
};

template <typename T, int TEAM, bool ENTROPY>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_fold_rows_kernel(
    const LinearFoldRowsParams q) {
  const LinearFoldParams& p = q.base;
  __shared__ TeamSmem smem;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  const bool in_range = row < p.n_rows;
  const long long id = in_range ? p.ids[row] : p.ignore_index;
  const float t = in_range ? q.row_t[row] : 1.0f;
  const bool ignored = id == p.ignore_index;
  const bool bad_id = !ignored && (id < 0 || id >= p.vocab);
  const bool bad = bad_id || (!ignored && !(t > 0.0f));  // NaN fails the comparison
  const bool active = in_range && !ignored && !bad;
  const float c = active ? row_log2e_over(t) : 1.0f;
  const bool leader = threadIdx.x % TEAM == 0;
  const T* row_ptr = static_cast<const T*>(p.tile) + (in_range ? row * p.row_stride : 0);
  const long long local = id - p.col0;
  const bool has_target = active && local >= 0 && local < p.cols;
  const float x_t = (has_target && leader) ? ElemTraits<T>::to_float(row_ptr[local]) : 0.0f;
  const RowState chunk = team_row_state<T, TEAM, ENTROPY>(row_ptr, p.cols, c, active, smem);
  if (!(in_range && leader)) return;
  if (active) {
    RowState st = chunk;
    float target = x_t;
    if (!p.first) {
      const float4 prev = p.state[row];
      st = merge_state<ENTROPY>(RowState{prev.x, prev.y, prev.z}, chunk);
      target = has_target ? x_t : prev.w;
    }
    if (!p.last) {
      p.state[row] = make_float4(st.m, st.s, st.t, target);
      return;
    }
    const RowResult r = finish_row<ENTROPY>(st);
    p.logp[row] = target_logp(target, c, r);
    if (ENTROPY) p.entropy[row] = r.entropy;
    p.stats[row] = make_float2(r.ref, r.log2s);
  } else if (p.last) {
    const float fill = ignored ? 0.0f : NAN;
    p.logp[row] = fill;
    if (ENTROPY) p.entropy[row] = fill;
    p.stats[row] = make_float2(fill, fill);
    if (bad_id) report_error(p.errors, p.row0 + row, id);
  }
}

struct LinearGradRowsParams {
  LinearGradParams base;   // p.c and p.inv_t unused: each row's come from row_t
  const float* row_t;      // [n_rows] temperatures (NaN: a bad row)
  float inv_cap;           // 1 / softcap, 0 without a softcap
  float scale;             // logit_scale (with a softcap; without one it is folded into row_t)
};

template <typename T, int TEAM, bool HAS_GH>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_grad_rows_kernel(
    const LinearGradRowsParams q) {
  const LinearGradParams& p = q.base;
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  if (row >= p.tile_rows) return;
  const int tid = threadIdx.x % TEAM;
  const bool pad = row >= p.n_rows;
  const long long id = pad ? p.ignore_index : p.ids[row];
  const float t = pad ? 1.0f : q.row_t[row];
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab || !(t > 0.0f));
  T* g_row = static_cast<T*>(p.tile) + row * p.row_stride;
  const bool aligned = (reinterpret_cast<uintptr_t>(g_row) & 15u) == 0;
  const int V = p.cols;
  if (ignored || bad) {
    fill_grad_row<T, TEAM>(g_row, V, aligned, tid, ignored ? 0.0f : NAN);
    return;
  }
  const float c = row_log2e_over(t);
  const RowGradCoeffs k = row_grad_coeffs<HAS_GH>(p.in, row, row_inverse(t));
  [[maybe_unused]] const bool capped = q.inv_cap > 0.0f;
  const long long local = id - p.col0;
  const int target = (local >= 0 && local < V) ? static_cast<int>(local) : -1;
  for (int base = 0; base < V; base += CHUNK) {
    RawVec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      v[u] = e0 < V ? load_vec<T>(g_row, e0, V, aligned) : neg_inf_vec<T>();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      float f[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float lp = fmaf(raw_elem<T>(v[u], i), c, -k.ref) - k.log2s;  // log2 p
        const float pr = fast_exp2(lp);
        f[i] = HAS_GH ? pr * fmaf(k.B, fmaxf(lp, kExpFloor), k.A) : pr * k.A;
      }
      if (static_cast<unsigned>(target - e0) < static_cast<unsigned>(VEC)) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (e0 + i == target) f[i] += k.G;
      }
      if constexpr (sizeof(T) == 4) {  // softcapped tiles are float32 (16-bit ones would spill: see the top)
        if (capped) {  // through the softcap: d x / d z = scale (1 - (x / cap)^2), x the tile's softcapped logit
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float r = raw_elem<T>(v[u], i) * q.inv_cap;
            f[i] *= q.scale * (1.0f - r * r);
          }
        }
      }
      pack_vec<T>(v[u], f);
      if (e0 < V) store_vec<T>(g_row, e0, V, aligned, v[u]);
    }
  }
}

// tile [rows, cols] (row stride row_stride) := cap * tanh(scale * tile / cap), in float, in place.
template <typename T>
__global__ void rlkernel_linear_logp_softcap_kernel(T* __restrict__ tile, long long row_stride, long long rows,
                                                    long long cols, float cap, float scale_over_cap) {
  const long long n = rows * cols;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const long long r = i / cols, col = i - r * cols;
    T* x = tile + r * row_stride + col;
    *x = from_float<T>(cap * tanhf(to_float_any<T>(*x) * scale_over_cap));
  }
}

}  // namespace rlkernel
