// The log-prob op (csrc/logp.cu's launchers): its schemas, thin tensor checks and CUDA impls, and the eager entry's
// body (torch_ops.h). The library itself is defined once, in csrc/library.cpp; this file adds a fragment.
// Only torch/library.h-level headers (the CI compile gate builds this file with the CPU torch wheel).
// Fake kernels and autograd live in Python (rlkernel/ops/fused/logp.py); input validation in rlkernel/validate.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>

#include "rlkernel/logp_api.h"
#include "torch_elem_type.h"
#include "torch_ops.h"

namespace {

using at::Tensor;

void check_rows(const Tensor& logits, const Tensor& ids) {
  TORCH_CHECK(logits.is_cuda(), "rlkernel: logits must be a CUDA tensor");
  TORCH_CHECK(logits.dim() == 2 && (logits.size(1) <= 1 || logits.stride(1) == 1), "rlkernel: logits must be [N, V] with a contiguous last dim");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "rlkernel: vocab size must be < 2^31");
  // the device error record keeps a row's position in 32 bits (error_record.h)
  TORCH_CHECK(logits.size(0) < (int64_t{1} << 31), "rlkernel: rows must be < 2^31");
  TORCH_CHECK(ids.device() == logits.device(), "rlkernel: token_ids must be on the logits' device");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() && ids.size(0) == logits.size(0),
              "rlkernel: token_ids must be contiguous int64 [N]");
}

const float* optional_rows(const std::optional<Tensor>& g, int64_t n, const Tensor& like, int64_t* stride) {
  *stride = 0;
  if (!g.has_value()) return nullptr;
  TORCH_CHECK(g->scalar_type() == at::kFloat && g->dim() == 1 && g->size(0) == n && g->device() == like.device(),
              "rlkernel: row gradients must be float32 [N] on the logits' device");
  *stride = g->stride(0);
  return g->data_ptr<float>();
}

// The fields the forward and backward launchers share: the rows, their ids, T, ignore_index and the stream.
template <class Args>
void fill_rows(Args& a, const Tensor& logits, const Tensor& ids, double temperature, int64_t ignore_index) {
  a.logits = logits.data_ptr();
  a.row_stride = logits.stride(0);
  a.ids = ids.data_ptr<int64_t>();
  a.n_rows = logits.size(0);
  a.vocab = logits.size(1);
  a.dtype = rlkernel::elem_type_of(logits, "rlkernel");
  a.temperature = temperature;
  a.ignore_index = ignore_index;
  a.stream = rlkernel::current_cuda_stream(logits.device().index());
}

}  // namespace

namespace rlkernel::ops {

std::tuple<Tensor, Tensor, Tensor> logp_forward_eager(const Tensor& logits, const Tensor& ids, double temperature,
                                                      int64_t ignore_index, bool compute_entropy, int64_t error_record,
                                                      int64_t error_seq, int64_t error_op) {
  check_rows(logits, ids);
  TORCH_CHECK(temperature > 0.0, "rlkernel: temperature must be > 0");
  c10::DeviceGuard guard(logits.device());
  const int64_t n = logits.size(0);
  auto f32 = logits.options().dtype(at::kFloat);
  Tensor logp = at::empty({n}, f32);
  Tensor entropy = at::empty({compute_entropy ? n : 0}, f32);
  Tensor stats = at::empty({n, 2}, f32);
  rlkernel::LogpForwardArgs a{};
  fill_rows(a, logits, ids, temperature, ignore_index);
  a.logp = logp.data_ptr<float>();
  a.entropy = compute_entropy ? entropy.data_ptr<float>() : nullptr;
  a.stats = stats.data_ptr<float>();
  a.errors = rlkernel::error_sink(error_record, error_seq, error_op);
  const char* err = rlkernel::logp_forward(a);
  TORCH_CHECK(err == nullptr, "rlkernel logp_forward: ", err);
  return {logp, entropy, stats};
}

}  // namespace rlkernel::ops

namespace {

// The registered op: the same call; `inplace_backward` and `requested` are for the autograd formula only.
std::tuple<Tensor, Tensor, Tensor> logp_forward(const Tensor& logits, const Tensor& ids, double temperature,
                                                int64_t ignore_index, bool compute_entropy, int64_t error_record,
                                                int64_t error_seq, int64_t error_op, bool /*inplace_backward*/,
                                                c10::string_view /*requested*/) {
  return rlkernel::ops::logp_forward_eager(logits, ids, temperature, ignore_index, compute_entropy, error_record,
                                           error_seq, error_op);
}

void logp_backward_into(const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
                        const Tensor& logits, const Tensor& ids, const Tensor& stats, const Tensor& entropy,
                        double temperature, int64_t ignore_index, const Tensor& grad) {
  check_rows(logits, ids);
  const int64_t n = logits.size(0);
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.numel() == 2 * n,
              "rlkernel: stats must be the forward's float32 [N, 2]");
  c10::DeviceGuard guard(logits.device());
  rlkernel::LogpBackwardArgs a{};
  fill_rows(a, logits, ids, temperature, ignore_index);
  a.grad = grad.data_ptr();
  a.grad_row_stride = grad.stride(0);
  a.grad_logp = optional_rows(grad_logp, n, logits, &a.grad_logp_stride);
  a.grad_entropy = optional_rows(grad_entropy, n, logits, &a.grad_entropy_stride);
  if (a.grad_entropy != nullptr) {
    TORCH_CHECK(entropy.scalar_type() == at::kFloat && entropy.is_contiguous() && entropy.numel() == n,
                "rlkernel: an entropy gradient needs the forward's float32 entropy [N]");
    a.entropy = entropy.data_ptr<float>();
  }
  a.stats = stats.data_ptr<float>();
  const char* err = rlkernel::logp_backward(a);
  TORCH_CHECK(err == nullptr, "rlkernel logp_backward: ", err);
}

Tensor logp_backward(const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
                     const Tensor& logits, const Tensor& ids, const Tensor& stats, const Tensor& entropy,
                     double temperature, int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2, "rlkernel: logits must be [N, V]");
  Tensor grad = at::empty({logits.size(0), logits.size(1)}, logits.options());
  logp_backward_into(grad_logp, grad_entropy, logits, ids, stats, entropy, temperature, ignore_index, grad);
  return grad;
}

void logp_backward_inplace(const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
                           Tensor& logits, const Tensor& ids, const Tensor& stats, const Tensor& entropy,
                           double temperature, int64_t ignore_index) {
  logp_backward_into(grad_logp, grad_entropy, logits, ids, stats, entropy, temperature, ignore_index, logits);
}

}  // namespace

// error_record/error_seq/error_op: where bad ids are reported (the record's device address as an integer, so the
// schema mutates no tensor argument and the op stays functional for autograd and torch.compile; 0 reports nothing).
// `inplace_backward` and `requested` are autograd metadata: the kernel ignores them, the autograd formula registered
// in Python reads them (in-place gradient; the backward's dispatch record carries the forward's request).
TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def(
      "logp_forward(Tensor logits, Tensor token_ids, float temperature, int ignore_index, bool compute_entropy, "
      "int error_record=0, int error_seq=0, int error_op=1, bool inplace_backward=False, str requested=\"fused\") "
      "-> (Tensor logp, Tensor entropy, Tensor stats)");
  m.def(
      "logp_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor token_ids, Tensor stats, "
      "Tensor entropy, float temperature, int ignore_index) -> Tensor");
  m.def(
      "logp_backward_inplace(Tensor? grad_logp, Tensor? grad_entropy, Tensor(a!) logits, Tensor token_ids, "
      "Tensor stats, Tensor entropy, float temperature, int ignore_index) -> ()");
}

TORCH_LIBRARY_IMPL(rlkernel, CUDA, m) {
  m.impl("logp_forward", &logp_forward);
  m.impl("logp_backward", &logp_backward);
  m.impl("logp_backward_inplace", &logp_backward_inplace);
}
