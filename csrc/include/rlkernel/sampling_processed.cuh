// The backward of the processed log-probs (the forward is the sampler's select / rows kernels in stats mode,
// sampling_kernels.cuh): one block per row, one read of the row and one write of its gradient. The kept set is the
// forward's, fixed: token j is kept iff pack_desc(key(x_j / T), j) >= the row's saved threshold, recomputed here
// with the forward's own expressions (scaled, float_key, pack_desc), so the two agree bit for bit.
#pragma once

#include "rlkernel/sampling_common.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kBwdThreads = 256;

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The gradient of one token: q = exp(log q) on the kept set, d/ds of g_l log q_id + g_H H, times 1/T.
struct ProcessedGrad {
  float s_max, log_s, h, inv_t, gl, gh;
  uint64_t threshold;
  int64_t id;
  __device__ __forceinline__ float operator()(float x, int64_t j) const {
    const float s = scaled(x, inv_t);
    if (pack_desc(float_key(s), j) < threshold) return 0.f;  // outside the kept set (a -inf logit: q = 0)
    const float lq = (s - s_max) - log_s;
    const float q = expf(lq);
    const float one = j == id ? gl : 0.f;
    return q > 0.f ? inv_t * (one - gl * q - gh * q * (lq + h)) : inv_t * one;
  }
};

template <typename T>
__global__ void __launch_bounds__(kBwdThreads)
    rlkernel_logp_processed_bwd(const T* __restrict__ logits, int64_t row_stride, int64_t vocab,
                                const int64_t* __restrict__ ids, int64_t ignore_index, const float4* __restrict__ stats,
                                const int64_t* __restrict__ threshold, const float* grad_logp, int64_t gl_stride,
                                const float* grad_entropy, int64_t gh_stride, T* grad, int64_t grad_row_stride) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * row_stride;
  T* g = grad + row * grad_row_stride;
  const int64_t id = ids[row];
  const float4 st = stats[row];
  const bool ignored = id == ignore_index;
  const bool bad = !ignored && (id < 0 || id >= vocab || st.x != st.x);
  if (ignored || bad || st.w == 0.f) {  // ignored and argmax rows: 0; rows the forward marked bad: NaN
    const T fill = from_float<T>(bad ? NAN : 0.f);
    for (int64_t j = threadIdx.x; j < vocab; j += kBwdThreads) g[j] = fill;
    return;
  }
  ProcessedGrad f{st.x, st.y, st.z, st.w, grad_logp ? grad_logp[row * gl_stride] : 0.f,
                  grad_entropy ? grad_entropy[row * gh_stride] : 0.f, static_cast<uint64_t>(threshold[row]), id};
  // an id outside the kept set has log-prob -inf, a constant: no g_l term anywhere in its row
  if (pack_desc(float_key(scaled(to_float(x[id]), f.inv_t)), id) < f.threshold) f.gl = 0.f;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16 == 0) && (reinterpret_cast<uintptr_t>(g) % 16 == 0);
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = vocab / kVec;
    for (int64_t v = threadIdx.x; v < nvec; v += kBwdThreads) {
      uint4 raw = __ldcs(reinterpret_cast<const uint4*>(x) + v);
      const T* xs = reinterpret_cast<const T*>(&raw);
      uint4 outv;
      T* os = reinterpret_cast<T*>(&outv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) os[i] = from_float<T>(f(to_float(xs[i]), v * kVec + i));
      __stcs(reinterpret_cast<uint4*>(g) + v, outv);
    }
    done = nvec * kVec;
  }
  for (int64_t j = done + threadIdx.x; j < vocab; j += kBwdThreads) g[j] = from_float<T>(f(to_float(x[j]), j));
}

}  // namespace sampling
}  // namespace rlkernel
