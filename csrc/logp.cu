// Launchers of the fused log-prob kernels. No torch include (the CI compile gate builds this with nvcc alone).
// Each launcher opens its NVTX op range (domain rlkernel) around everything it puts on the stream: one rlkernel_*
// kernel, nothing else (bad ids go to the device's error record from inside the kernel).
#include <cuda_runtime.h>
#include <nvtx3/nvtx3.hpp>

#include "rlkernel/launch.cuh"
#include "rlkernel/logp_api.h"
#include "rlkernel/logp_kernels.cuh"

namespace rlkernel {
namespace {

using launch::inverse;
using launch::launch_row_kernel;
using launch::log2e_over;
using launch::row_grad_inputs;

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

}  // namespace

int logp_row_team(int64_t vocab, ElemType dtype) {
  return row_team_threads(vocab, dtype == ElemType::kFloat32 ? 4 : 2);
}

const char* logp_forward(const LogpForwardArgs& a) {
  auto range = op_range<FwdMessage>();
  if (a.n_rows == 0) return nullptr;
  LogpFwdParams p;
  p.logits = a.logits;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.vocab = static_cast<int>(a.vocab);
  p.c = log2e_over(a.temperature);
  p.ignore_index = a.ignore_index;
  p.logp = a.logp;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<float2*>(a.stats);
  p.errors = a.errors;
  return launch_row_kernel(a.dtype, a.vocab, a.n_rows, a.entropy != nullptr, a.stream, p,
                           [](auto tag, auto team, auto entropy) {
                             return rlkernel_logp_fwd_kernel<decltype(tag), decltype(team)::value,
                                                             decltype(entropy)::value>;
                           });
}

const char* logp_backward(const LogpBackwardArgs& a) {
  auto range = op_range<BwdMessage>();
  if (a.n_rows == 0 || a.vocab == 0) return nullptr;
  LogpBwdParams p;
  p.logits = a.logits;
  p.row_stride = a.row_stride;
  p.grad = a.grad;
  p.grad_row_stride = a.grad_row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.vocab = static_cast<int>(a.vocab);
  p.c = log2e_over(a.temperature);
  p.inv_t = inverse(a.temperature);
  p.ignore_index = a.ignore_index;
  p.in = row_grad_inputs(a);
  return launch_row_kernel(a.dtype, a.vocab, a.n_rows, a.grad_entropy != nullptr, a.stream, p,
                           [](auto tag, auto team, auto has_gh) {
                             return rlkernel_logp_bwd_kernel<decltype(tag), decltype(team)::value,
                                                             decltype(has_gh)::value>;
                           });
}

}  // namespace rlkernel
