// Launchers of the fused log-prob kernels. No torch include (the CI compile gate builds this with nvcc alone).
// Each launcher opens its NVTX op range (domain rlkernel) around everything it puts on the stream: one rlkernel_*
// kernel, nothing else (bad ids go to the device's error record from inside the kernel).
#include <cuda_runtime.h>
#include <nvtx3/nvtx3.hpp>

#include "rlkernel/logp_api.h"
#include "rlkernel/logp_kernels.cuh"

namespace rlkernel {
namespace {

struct NvtxDomain {
  static constexpr char const* name{"rlkernel"};
};
struct FwdMessage {
  static constexpr char const* message{"op.logp.forward"};
};
struct BwdMessage {
  static constexpr char const* message{"op.logp.backward"};
};

template <class Message> nvtx3::scoped_range_in<NvtxDomain> op_range() {
  return nvtx3::scoped_range_in<NvtxDomain>{
      nvtx3::event_attributes{nvtx3::registered_string_in<NvtxDomain>::get<Message>()}};
}

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Calls f(T{}, std::integral_constant<int, TEAM>{}) for the element type and the row team of vocab V.
template <class F> const char* with_type_and_team(ElemType dtype, int64_t V, F&& f) {
  auto by_team = [&](auto tag) -> const char* {
    using T = decltype(tag);
    switch (row_team_threads(V, sizeof(T))) {
      case 32: f(tag, std::integral_constant<int, 32>{}); break;
      case 64: f(tag, std::integral_constant<int, 64>{}); break;
      case 128: f(tag, std::integral_constant<int, 128>{}); break;
      case 256: f(tag, std::integral_constant<int, 256>{}); break;
      default: f(tag, std::integral_constant<int, 512>{}); break;
    }
    return nullptr;
  };
  switch (dtype) {
    case ElemType::kFloat32: return by_team(float{});
    case ElemType::kFloat16: return by_team(__half{});
    case ElemType::kBFloat16: return by_team(__nv_bfloat16{});
  }
  return "rlkernel: unknown element type";
}

unsigned grid_for(int64_t n_rows, int team) {
  const int64_t teams_per_cta = kCtaThreads / team;
  return static_cast<unsigned>((n_rows + teams_per_cta - 1) / teams_per_cta);
}

}  // namespace

int logp_row_team(int64_t vocab, ElemType dtype) {
  return row_team_threads(vocab, dtype == ElemType::kFloat32 ? 4 : 2);
}

const char* logp_forward(const LogpForwardArgs& a) {
  auto range = op_range<FwdMessage>();
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.n_rows == 0) return nullptr;
  LogpFwdParams p;
  p.logits = a.logits;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.vocab = static_cast<int>(a.vocab);
  p.c = static_cast<float>(1.4426950408889634 / a.temperature);
  p.ignore_index = a.ignore_index;
  p.logp = a.logp;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<float2*>(a.stats);
  p.errors = a.errors;
  const char* err = with_type_and_team(a.dtype, a.vocab, [&](auto tag, auto team) {
    using T = decltype(tag);
    constexpr int TEAM = decltype(team)::value;
    const unsigned grid = grid_for(a.n_rows, TEAM);
    if (a.entropy != nullptr) {
      rlkernel_logp_fwd_kernel<T, TEAM, true><<<grid, kCtaThreads, 0, stream>>>(p);
    } else {
      rlkernel_logp_fwd_kernel<T, TEAM, false><<<grid, kCtaThreads, 0, stream>>>(p);
    }
  });
  return err ? err : last_error();
}

const char* logp_backward(const LogpBackwardArgs& a) {
  auto range = op_range<BwdMessage>();
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (a.n_rows == 0 || a.vocab == 0) return nullptr;
  LogpBwdParams p;
  p.logits = a.logits;
  p.row_stride = a.row_stride;
  p.grad = a.grad;
  p.grad_row_stride = a.grad_row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.vocab = static_cast<int>(a.vocab);
  p.c = static_cast<float>(1.4426950408889634 / a.temperature);
  p.inv_t = static_cast<float>(1.0 / a.temperature);
  p.ignore_index = a.ignore_index;
  p.grad_logp = a.grad_logp;
  p.grad_logp_stride = a.grad_logp_stride;
  p.grad_entropy = a.grad_entropy;
  p.grad_entropy_stride = a.grad_entropy_stride;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<const float2*>(a.stats);
  const char* err = with_type_and_team(a.dtype, a.vocab, [&](auto tag, auto team) {
    using T = decltype(tag);
    constexpr int TEAM = decltype(team)::value;
    const unsigned grid = grid_for(a.n_rows, TEAM);
    if (a.grad_entropy != nullptr) {
      rlkernel_logp_bwd_kernel<T, TEAM, true><<<grid, kCtaThreads, 0, stream>>>(p);
    } else {
      rlkernel_logp_bwd_kernel<T, TEAM, false><<<grid, kCtaThreads, 0, stream>>>(p);
    }
  });
  return err ? err : last_error();
}

}  // namespace rlkernel
