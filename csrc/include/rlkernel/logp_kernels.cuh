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
#include "rlkernel/row_grad.cuh"
#include "rlkernel/row_reduce.cuh"

namespace rlkernel {

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
  RowGradInputs in;  // g_l, g_H, the forward's entropy and stats (row_grad.cuh)
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
    fill_grad_row<T, TEAM>(g_row, V, g_aligned, tid, ignored ? 0.0f : NAN);
    return;
  }
  const RowGradCoeffs k = row_grad_coeffs<HAS_GH>(p.in, row, p.inv_t);
  const int target = static_cast<int>(id);
  // the same loop as rlkernel_linear_logp_grad_kernel's, kept written out in each (row_grad.cuh says why)
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
        const float lp = fmaf(raw_elem<T>(v[u], i), p.c, -k.ref) - k.log2s;  // log2 p
        const float pr = fast_exp2(lp);
        // p = 0 (a -inf logit) gives 0 * finite: the clamp keeps B * log2 p finite.
        f[i] = HAS_GH ? pr * fmaf(k.B, fmaxf(lp, kExpFloor), k.A) : pr * k.A;
      }
      if (static_cast<unsigned>(target - e0) < static_cast<unsigned>(VEC)) {
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (e0 + i == target) f[i] += k.G;
      }
      pack_vec<T>(v[u], f);
      if (e0 < V) store_vec<T>(g_row, e0, V, g_aligned, v[u]);
    }
  }
}

}  // namespace rlkernel
