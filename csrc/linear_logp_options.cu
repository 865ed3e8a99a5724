// Launchers of rlkernel.linear_logp's option kernels (csrc/include/rlkernel/linear_logp_options_kernels.cuh): the
// per-row temperature's fold and grad, the softcap, and the fold with the extra statistics of `outputs`. No torch
// include (the CI compile gate builds this with nvcc alone); no NVTX range (the op's range is opened in Python
// around the GEMMs and these launches).
#include <cuda_runtime.h>

#include <climits>

#include "rlkernel/launch.cuh"
#include "rlkernel/linear_logp_options_api.h"
#include "rlkernel/linear_logp_options_kernels.cuh"

namespace rlkernel {
namespace {

using launch::last_error;
using launch::launch_row_kernel;
using launch::row_grad_inputs;
using launch::with_type;

// The fold_rows kernel's params (fold_extras wraps them).
LinearFoldRowsParams fold_rows_params(const LinearFoldArgs& a, const float* row_t) {
  LinearFoldRowsParams q;
  LinearFoldParams& p = q.base;
  p.tile = a.tile;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.cols = static_cast<int>(a.cols);
  p.col0 = a.col0;
  p.vocab = a.vocab;
  p.c = 0.0f;  // per row
  p.ignore_index = a.ignore_index;
  p.state = reinterpret_cast<float4*>(a.state);
  p.first = a.first;
  p.last = a.last;
  p.logp = a.logp;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<float2*>(a.stats);
  p.row0 = a.row0;
  p.errors = a.errors;
  q.row_t = row_t;
  return q;
}

}  // namespace

const char* linear_logp_fold_rows(const LinearFoldArgs& a, const float* row_t) {
  if (a.n_rows == 0) return nullptr;
  return launch_row_kernel(a.dtype, a.cols, a.n_rows, a.entropy != nullptr, a.stream, fold_rows_params(a, row_t),
                           [](auto tag, auto team, auto entropy) {
                             return rlkernel_linear_logp_fold_rows_kernel<decltype(tag), decltype(team)::value,
                                                                          decltype(entropy)::value>;
                           });
}

const char* linear_logp_fold_extras(const LinearFoldArgs& a, const float* row_t, const LinearExtrasArgs& x) {
  if (a.n_rows == 0) return nullptr;
  if (a.vocab >= INT_MAX) return "rlkernel linear_logp: outputs need a vocabulary below 2^31 - 1 columns";
  LinearExtrasParams q;
  q.rows = fold_rows_params(a, row_t);
  q.xstate = reinterpret_cast<float4*>(x.xstate);
  q.log_sum_sq = x.log_sum_sq;
  q.mean_logit = x.mean_logit;
  q.is_top1 = x.is_top1;
  return launch_row_kernel(a.dtype, a.cols, a.n_rows, a.entropy != nullptr, a.stream, q,
                           [](auto tag, auto team, auto entropy) {
                             return rlkernel_linear_logp_fold_extras_kernel<decltype(tag), decltype(team)::value,
                                                                            decltype(entropy)::value>;
                           });
}

const char* linear_logp_grad_rows(const LinearGradArgs& a, const float* row_t, double softcap, double logit_scale) {
  if (a.tile_rows == 0 || a.cols == 0) return nullptr;
  if (softcap > 0.0 && a.dtype != ElemType::kFloat32) return "rlkernel linear_logp: a softcapped tile must be float32";
  LinearGradRowsParams q;
  LinearGradParams& p = q.base;
  p.tile = a.tile;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.tile_rows = a.tile_rows;
  p.cols = static_cast<int>(a.cols);
  p.col0 = a.col0;
  p.vocab = a.vocab;
  p.c = 0.0f;  // per row
  p.inv_t = 0.0f;
  p.ignore_index = a.ignore_index;
  p.in = row_grad_inputs(a);
  q.row_t = row_t;
  q.inv_cap = softcap > 0.0 ? static_cast<float>(1.0 / softcap) : 0.0f;
  q.scale = static_cast<float>(logit_scale);
  return launch_row_kernel(a.dtype, a.cols, a.tile_rows, a.grad_entropy != nullptr, a.stream, q,
                           [](auto tag, auto team, auto has_gh) {
                             return rlkernel_linear_logp_grad_rows_kernel<decltype(tag), decltype(team)::value,
                                                                          decltype(has_gh)::value>;
                           });
}

const char* linear_logp_softcap(void* tile, int64_t row_stride, int64_t rows, int64_t cols, ElemType dtype,
                                double softcap, double logit_scale, void* stream_ptr) {
  if (rows * cols == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t blocks64 = (rows * cols + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65536 ? blocks64 : 65536);
  const float cap = static_cast<float>(softcap), scale_over_cap = static_cast<float>(logit_scale / softcap);
  const char* err = with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    rlkernel_linear_logp_softcap_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<T*>(tile), row_stride, rows, cols,
                                                                       cap, scale_over_cap);
  });
  return err ? err : last_error();
}

}  // namespace rlkernel
