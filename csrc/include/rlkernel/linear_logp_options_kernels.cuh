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
// - fold_extras: fold_rows plus the statistics of `outputs` (log sum p^2, the mean of z', whether the id is z''s
//   first argmax), in the same launch over the same tile: a second walk of the team's row (team_row_extras), which
//   re-reads what team_row_state just read (L2-resident: a CTA's rows are a few tens of KiB) and needs the chunk's
//   max for its sum of squares. A separate kernel name, so fold_rows and the plain fold stay as they are.
#pragma once

#include <climits>

#include "rlkernel/linear_logp_kernels.cuh"

namespace rlkernel {

// log2(e) / t and 1 / t in float32, correctly rounded (in double they spilled registers in grad_rows).
__device__ __forceinline__ float row_log2e_over(float t) { return __fdiv_rn(kLog2e, t); }
__device__ __forceinline__ float row_inverse(float t) { return __frcp_rn(t); }

struct LinearFoldRowsParams {
  LinearFoldParams base;   // p.c unused: each row's c comes from row_t
  const float* row_t;      // [n_rows] temperatures (NaN: a bad row)
};

// The extra statistics' outputs and running state (fold_extras only).
struct LinearExtrasParams {
  LinearFoldRowsParams rows;
  float4* xstate;          // [n_rows]: (s2, sum x, best x, best column as int bits) after the chunks so far
  float* log_sum_sq;       // [n_rows] log sum_j p_j^2 (last chunk)
  float* mean_logit;       // [n_rows] mean_j z'_j = (sum_j x_j) / (T_row V)
  bool* is_top1;           // [n_rows] the id is the first argmax of the row
};

// A row part's extra statistics, x the tile's logits (softcapped, unscaled by T) and y = x c as in row_reduce.cuh:
// s2 = sum 2^(2 (y - ref)) (ref: the part's state_ref), sum = sum x, and the first argmax of x (best, idx).
// z' = x / T_row is an increasing function of x, so x's first argmax is z''s.
struct RowExtras {
  float s2;
  float sum;
  float best;
  int idx;  // the column of best (INT_MAX: none yet)
};

__device__ __forceinline__ RowExtras empty_extras() { return RowExtras{0.0f, 0.0f, -INFINITY, INT_MAX}; }

// Whether (a, ia) comes first in torch.argmax's order: NaN above every number (the first NaN wins), then the
// larger value, then the lower column. Symmetric, so butterfly lanes agree.
__device__ __forceinline__ bool argmax_first(float a, int ia, float b, int ib) {
  const bool an = isnan(a), bn = isnan(b);
  if (an != bn) return an;
  if (!an && a != b) return a > b;
  return ia < ib;
}

// Merge of two parts whose s2 share one ref (the team's parts: one chunk, one ref).
__device__ __forceinline__ RowExtras merge_extras(const RowExtras& a, const RowExtras& b) {
  const bool a_first = argmax_first(a.best, a.idx, b.best, b.idx);
  return RowExtras{a.s2 + b.s2, a.sum + b.sum, a_first ? a.best : b.best, a_first ? a.idx : b.idx};
}

__device__ __forceinline__ RowExtras warp_merge_extras(RowExtras x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) {
    RowExtras o;
    o.s2 = __shfl_xor_sync(0xffffffffu, x.s2, off);
    o.sum = __shfl_xor_sync(0xffffffffu, x.sum, off);
    o.best = __shfl_xor_sync(0xffffffffu, x.best, off);
    o.idx = __shfl_xor_sync(0xffffffffu, x.idx, off);
    x = merge_extras(x, o);
  }
  return x;
}

struct ExtrasSmem {
  RowExtras warp_extras[kCtaThreads / 32];
};

// The extras of one row's tile part of V elements, by a team of TEAM threads, relative to ref (the part's
// state_ref from team_row_state, base 2). The calling rules of team_row_state: every thread of the CTA calls it.
// The element ownership is team_row_state's; each thread sees its columns in increasing order, so a strict
// comparison keeps its first argmax. One vector at a time (the row was just read by team_row_state: L2 hits, and
// fewer live registers than its kUnroll vectors in flight).
template <typename T, int TEAM>
__device__ __forceinline__ RowExtras team_row_extras(const T* __restrict__ row, int V, float c, float ref,
                                                     bool active, ExtrasSmem& smem) {
  constexpr int VEC = ElemTraits<T>::kVec;
  const int tid = threadIdx.x % TEAM;
  RowExtras x = empty_extras();
  if (active) {
    const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
    for (int e0 = tid * VEC; e0 < V; e0 += TEAM * VEC) {  // team_row_state's vectors, in column order
      const RawVec v = load_vec<T>(row, e0, V, aligned);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (e0 + i < V) {  // past the row: the -inf fill, not a column
          const float xv = raw_elem<T>(v, i);
          const float e = fast_exp2(fmaf(xv, c, -ref));
          x.s2 = fmaf(e, e, x.s2);
          x.sum += xv;
          if (argmax_first(xv, e0 + i, x.best, x.idx)) {
            x.best = xv;
            x.idx = e0 + i;
          }
        }
      }
    }
  }
  x = warp_merge_extras(x);
  if constexpr (TEAM > 32) {
    constexpr int W = TEAM / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) smem.warp_extras[warp] = x;
    __syncthreads();
    const int first = (threadIdx.x / TEAM) * W;
    x = lane < W ? smem.warp_extras[first + lane] : empty_extras();
    x = warp_merge_extras(x);
  }
  return x;
}

// The running extras after this chunk: prev (relative to prev_m's ref) and the chunk's (relative to chunk_m's),
// both rescaled to the merged max m as merge_state rescales s (squared: s2 sums squares).
__device__ __forceinline__ RowExtras merge_chunk_extras(const float4& prev, float prev_m, const RowExtras& chunk,
                                                        float chunk_m, float m) {
  const float r = state_ref(m);
  const float ea = fast_exp2(fmaxf(prev_m - r, -FLT_MAX)), eb = fast_exp2(fmaxf(chunk_m - r, -FLT_MAX));
  const int prev_idx = __float_as_int(prev.w);
  const bool prev_first = argmax_first(prev.z, prev_idx, chunk.best, chunk.idx);
  return RowExtras{fmaf(ea * ea, prev.x, eb * eb * chunk.s2), prev.y + chunk.sum, prev_first ? prev.z : chunk.best,
                   prev_first ? prev_idx : chunk.idx};
}

// fold_rows (EXTRAS false) or fold_extras (true) of one tile: the body both kernels share.
template <typename T, int TEAM, bool ENTROPY, bool EXTRAS>
__device__ __forceinline__ void fold_rows_body(const LinearFoldRowsParams& q, const LinearExtrasParams* xp) {
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
  [[maybe_unused]] RowExtras xc = empty_extras();
  if constexpr (EXTRAS) {
    __shared__ ExtrasSmem xsmem;
    xc = team_row_extras<T, TEAM>(row_ptr, p.cols, c, state_ref(chunk.m), active, xsmem);
    xc.idx = xc.idx == INT_MAX ? INT_MAX : static_cast<int>(p.col0) + xc.idx;  // the vocabulary column
  }
  if (!(in_range && leader)) return;
  if (active) {
    RowState st = chunk;
    float target = x_t;
    [[maybe_unused]] RowExtras xs = xc;
    if (!p.first) {
      const float4 prev = p.state[row];
      st = merge_state<ENTROPY>(RowState{prev.x, prev.y, prev.z}, chunk);
      target = has_target ? x_t : prev.w;
      if constexpr (EXTRAS) xs = merge_chunk_extras(xp->xstate[row], prev.x, xc, chunk.m, st.m);
    }
    if (!p.last) {
      p.state[row] = make_float4(st.m, st.s, st.t, target);
      if constexpr (EXTRAS) xp->xstate[row] = make_float4(xs.s2, xs.sum, xs.best, __int_as_float(xs.idx));
      return;
    }
    const RowResult r = finish_row<ENTROPY>(st);
    p.logp[row] = target_logp(target, c, r);
    if (ENTROPY) p.entropy[row] = r.entropy;
    p.stats[row] = make_float2(r.ref, r.log2s);
    if constexpr (EXTRAS) {  // log sum p^2 = log2 s2 - 2 log2 s (one ref), in nats; z' = x / T_row
      xp->log_sum_sq[row] = kLn2 * (log2f(xs.s2) - 2.0f * r.log2s);
      xp->mean_logit[row] = xs.sum / t / static_cast<float>(p.vocab);
      xp->is_top1[row] = static_cast<long long>(xs.idx) == id;
    }
  } else if (p.last) {
    const float fill = ignored ? 0.0f : NAN;
    p.logp[row] = fill;
    if (ENTROPY) p.entropy[row] = fill;
    p.stats[row] = make_float2(fill, fill);
    if constexpr (EXTRAS) {
      xp->log_sum_sq[row] = fill;
      xp->mean_logit[row] = fill;
      xp->is_top1[row] = false;
    }
    if (bad_id) report_error(p.errors, p.row0 + row, id);
  }
}

template <typename T, int TEAM, bool ENTROPY>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_fold_rows_kernel(
    const LinearFoldRowsParams q) {
  fold_rows_body<T, TEAM, ENTROPY, false>(q, nullptr);
}

template <typename T, int TEAM, bool ENTROPY>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_fold_extras_kernel(
    const LinearExtrasParams x) {
  fold_rows_body<T, TEAM, ENTROPY, true>(x.rows, &x);
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
