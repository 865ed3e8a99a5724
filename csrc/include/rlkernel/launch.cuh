// Host-side launch helpers shared by the launchers of the log-prob kernels (csrc/logp.cu) and of the fused
// LM-head log-prob kernels (csrc/linear_logp.cu). nvcc only; no torch include (the CI compile gate builds the
// launchers with nvcc alone). The row kernels are instantiated <T, TEAM, FLAG>: the element type, the row team
// (row_reduce.cuh) and one bool feature (entropy in the forward, an entropy gradient in the backward); these
// helpers turn the runtime (dtype, row length, flag) into that instantiation, so each launcher only fills its
// params. The set of instantiations, their launch shape and their names are those the launchers used to spell out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "rlkernel/common_api.h"  // ElemType, RowGradArgs
#include "rlkernel/row_grad.cuh"
#include "rlkernel/row_reduce.cuh"

namespace rlkernel::launch {

// nullptr, or the message of the launch error the last launch left.
inline const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// log2(e) / T (log2e_over, common_api.h: the sampler's raw log-probs take it too) and 1 / T, the kernels' scales,
// rounded once from double.
using ::rlkernel::log2e_over;
inline float inverse(double temperature) { return static_cast<float>(1.0 / temperature); }

// Calls f(T{}) for the element type.
template <class F> const char* with_type(ElemType dtype, F&& f) {
  switch (dtype) {
    case ElemType::kFloat32: f(float{}); return nullptr;
    case ElemType::kFloat16: f(__half{}); return nullptr;
    case ElemType::kBFloat16: f(__nv_bfloat16{}); return nullptr;
  }
  return "rlkernel: unknown element type";
}

// Calls f(T{}, std::integral_constant<int, TEAM>{}) for the element type and the row team of a row of `cols`
// elements (a function of cols and sizeof(T) only: see row_team_threads).
template <class F> const char* with_type_and_team(ElemType dtype, int64_t cols, F&& f) {
  return with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (row_team_threads(cols, sizeof(T))) {
      case 32: f(tag, std::integral_constant<int, 32>{}); break;
      case 64: f(tag, std::integral_constant<int, 64>{}); break;
      case 128: f(tag, std::integral_constant<int, 128>{}); break;
      case 256: f(tag, std::integral_constant<int, 256>{}); break;
      default: f(tag, std::integral_constant<int, 512>{}); break;
    }
  });
}

// CTAs of kCtaThreads for n_rows rows, kCtaThreads / team rows a CTA.
inline unsigned grid_for(int64_t n_rows, int team) {
  const int64_t teams_per_cta = kCtaThreads / team;
  return static_cast<unsigned>((n_rows + teams_per_cta - 1) / teams_per_cta);
}

// Launches one row kernel over n_rows rows of `cols` elements: kernel_for(T{}, integral_constant<int, TEAM>{},
// bool_constant<FLAG>{}) names the instantiation (both FLAG values are instantiated: the flag is known only at
// run time), launched on grid_for(n_rows, TEAM) x kCtaThreads, no dynamic shared memory, with `params`.
template <class Params, class KernelFor>
const char* launch_row_kernel(ElemType dtype, int64_t cols, int64_t n_rows, bool flag, void* stream,
                              const Params& params, KernelFor&& kernel_for) {
  const char* err = with_type_and_team(dtype, cols, [&](auto tag, auto team) {
    const auto kernel = flag ? kernel_for(tag, team, std::true_type{}) : kernel_for(tag, team, std::false_type{});
    kernel<<<grid_for(n_rows, decltype(team)::value), kCtaThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
  });
  return err ? err : last_error();
}

// The rows' gradient inputs, as the backward kernels read them.
inline RowGradInputs row_grad_inputs(const RowGradArgs& a) {
  RowGradInputs in;
  in.grad_logp = a.grad_logp;
  in.grad_logp_stride = a.grad_logp_stride;
  in.grad_entropy = a.grad_entropy;
  in.grad_entropy_stride = a.grad_entropy_stride;
  in.entropy = a.entropy;
  in.stats = reinterpret_cast<const float2*>(a.stats);
  return in;
}

}  // namespace rlkernel::launch
