// Device code of the gradient of a row's log-prob (and entropy), shared by rlkernel_logp_bwd_kernel
// (logp_kernels.cuh, whole rows of logits) and rlkernel_linear_logp_grad_kernel (linear_logp_kernels.cuh, one
// vocabulary chunk of a row):
//   grad_x = (1/T) [g_l (onehot - p) - g_H p (log p + H)] = p * (A + B * log2 p) + onehot * G,
// with every p recomputed from the forward's stats (r, log2 s) without another reduction. Framework-free.
// Thread layout as the row reduction (row_reduce.cuh): a team of TEAM threads per row, chunks of
// TEAM * kUnroll * VEC elements, thread tid of the team owning the vectors at (u * TEAM + tid) * VEC.
// The per-element loop itself stays written out in each kernel: as one shared __forceinline__ function it compiled
// to other SASS for the fp32 linear and every logp backward instantiation, and on the H200 (2026-12-03) changed 69
// bytes of a 274 MB bit-exactness harness's output; inline, both kernels' SASS is byte-identical to the verified one.
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

}  // namespace rlkernel
