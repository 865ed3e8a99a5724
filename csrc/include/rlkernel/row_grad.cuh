// Device code of the gradient of a row's log-prob (and entropy), shared by rlkernel_logp_bwd_kernel
// (logp_kernels.cuh, whole rows of logits) and rlkernel_linear_logp_grad_kernel (linear_logp_kernels.cuh, one
// vocabulary chunk of a row), so that both compute the same numbers in the same order, bit for bit:
//   grad_x = (1/T) [g_l (onehot - p) - g_H p (log p + H)] = p * (A + B * log2 p) + onehot * G,
// with every p recomputed from the forward's stats (r, log2 s) without another reduction. Framework-free.
// Thread layout as the row reduction (row_reduce.cuh): a team of TEAM threads per row, chunks of
// TEAM * kUnroll * VEC elements, thread tid of the team owning the vectors at (u * TEAM + tid) * VEC. The kernels
// pass tid in, computed once at their top, and the inputs travel by value, not as references into the kernel's
// parameter space: both keep the generated code close to what each kernel had inline (same arithmetic, in the
// same order).
#pragma once

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

// The per-row inputs of the gradient besides the logits. A member of both kernels' params, right after their
// 8-byte aligned ignore_index, so the params keep the layout they had when these were separate fields.
struct RowGradInputs {
  const float* grad_logp;  // [N] with stride, or nullptr (no gradient reaches logp)
  long long grad_logp_stride;
  const float* grad_entropy;  // [N] with stride (used with HAS_GH)
  long long grad_entropy_stride;
  const float* entropy;  // [N] forward entropy (used with HAS_GH)
  const float2* stats;   // [N] from the forward: (r, log2 s)
};

// One row's stats and coefficients: grad = p * (A + B * log2 p) + onehot * G.
struct RowGradCoeffs {
  float ref, log2s;  // the forward's stats (r, log2 s): log2 p = x * c - r - log2 s
  float A, B, G;
};

template <bool HAS_GH>
__device__ __forceinline__ RowGradCoeffs row_grad_coeffs(const RowGradInputs in, long long row, float inv_t) {
  RowGradCoeffs k;
  const float2 st = in.stats[row];
  k.ref = st.x;
  k.log2s = st.y;
  const float gl = in.grad_logp ? in.grad_logp[row * in.grad_logp_stride] : 0.0f;
  const float gh = HAS_GH ? in.grad_entropy[row * in.grad_entropy_stride] : 0.0f;
  const float H = HAS_GH ? in.entropy[row] : 0.0f;
  // from g_l (onehot - p) - g_H p (ln2 log2 p + H), over T
  k.A = -(gl + gh * H) * inv_t;
  k.B = -gh * kLn2 * inv_t;
  k.G = gl * inv_t;
  return k;
}

// Writes `value` over the V elements of a row that gets no computed gradient (0: an ignored or padding row, so
// the GEMMs get nothing from it; NaN: a bad id). The row is not read.
template <typename T, int TEAM>
__device__ __forceinline__ void fill_grad_row(T* g_row, int V, bool g_aligned, int tid, float value) {
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
  const RawVec fill = fill_vec<T>(value);
  for (int base = 0; base < V; base += CHUNK)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      if (e0 < V) store_vec<T>(g_row, e0, V, g_aligned, fill);
    }
}

// The gradient of the V logits at x_row into g_row; target: the target's element in the row, or -1 where the
// target lies outside it (another vocabulary chunk). g_row may equal x_row (in place): each element is read and
// then written by the same thread, hence no __restrict__ on them here.
template <typename T, int TEAM, bool HAS_GH>
__device__ __forceinline__ void write_grad_row(const T* x_row, bool x_aligned, T* g_row, bool g_aligned, int V,
                                               int tid, int target, float c, const RowGradCoeffs k) {
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
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
        const float lp = fmaf(raw_elem<T>(v[u], i), c, -k.ref) - k.log2s;  // log2 p
        const float pr = fast_exp2(lp);
        // p = 0 (a -inf logit) gives 0 * finite: the clamp keeps B * log2 p finite.
        f[i] = HAS_GH ? pr * fmaf(k.B, fmaxf(lp, kExpFloor), k.A) : pr * k.A;
      }
      if (static_cast<unsigned>(target - e0) < static_cast<unsigned>(VEC)) {  // target -1: never
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
