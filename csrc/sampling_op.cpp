// The registered op rlkernel::sample (schema, thin tensor checks, the call into csrc/sampling.cu) and its
// randomness: the Philox state of a CUDA generator for one call, advanced as torch's own random kernels advance
// it (philox_cuda_state), so seeded calls reproduce and CUDA-graph replays draw afresh. The fake kernel and
// input validation live in Python (rlkernel/ops/fused/sampling.py, rlkernel/validate.py).
// Headers: CUDAGeneratorImpl.h also ships with the CPU wheel, so this file compiles there too (no link).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <tuple>

#include "rlkernel/common_api.h"  // current_cuda_stream (csrc/cuda_stream.cpp)
#include "rlkernel/sampling_api.h"
#include "torch_elem_type.h"
#include "torch_ops.h"

namespace {

using at::Tensor;

rlkernel::PhiloxArgs philox_args(const std::optional<at::Generator>& generator, int device_index,
                                 uint64_t increment) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      generator, at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(device_index)));
  // torch.Generator(device="cuda") carries no index (-1), and torch's own random ops accept it on any device;
  // only an indexed generator on another device is refused.
  const int gen_index = gen->device().index();
  TORCH_CHECK(gen_index < 0 || gen_index == device_index, "rlkernel sample: the generator is on ", gen->device(),
              ", the logits on cuda:", device_index);
  at::PhiloxCudaState state;
  try {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(increment);
  } catch (const c10::Error& e) {
    // torch's own message ("Attempt to increase offset for a CUDA generator not in capture mode") does not say
    // what to do: a user generator must be registered with the graph, as for torch's own random ops.
    TORCH_CHECK(false, "rlkernel sample: this generator cannot draw here (", e.msg(), "). Inside CUDA-graph capture, ",
                "register it with the graph first: graph.register_generator_state(generator)");
  }
  rlkernel::PhiloxArgs args;
  if (state.captured_) {
    args.captured = true;
    args.seed_ptr = state.seed_.ptr;
    args.offset_ptr = state.offset_.ptr;
    args.offset_intragraph = state.offset_intragraph_;
  } else {
    args.seed = state.seed_.val;
    args.offset = state.offset_.val;
  }
  return args;
}

// A per-row setting: nullptr, or the data of a contiguous [N] tensor of `dtype` on the logits' device.
template <typename V>
const V* rows_of(const std::optional<Tensor>& t, const Tensor& logits, at::ScalarType dtype, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == logits.device() && t->scalar_type() == dtype && t->dim() == 1 &&
                  t->size(0) == logits.size(0) && t->is_contiguous(),
              "rlkernel: ", name, " per row must be a contiguous ", c10::toString(dtype), " [N] tensor on ",
              logits.device());
  return t->data_ptr<V>();
}

// The settings of one call: scalars, checked here, and per-row tensors, whose values only the kernels read.
rlkernel::SampleSettings settings_of(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                     double min_p, const std::optional<Tensor>& temperature_rows,
                                     const std::optional<Tensor>& top_k_rows, const std::optional<Tensor>& top_p_rows,
                                     const std::optional<Tensor>& min_p_rows) {
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0 && top_p > 0.0 && top_p <= 1.0 && min_p >= 0.0 && min_p <= 1.0,
              "rlkernel sample: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1");
  rlkernel::SampleSettings s;
  s.temperature = static_cast<float>(temperature);
  s.top_k = top_k;
  s.top_p = top_p;
  s.min_p = static_cast<float>(min_p);
  s.temperature_rows = rows_of<float>(temperature_rows, logits, at::kFloat, "temperature");
  s.top_k_rows = rows_of<int64_t>(top_k_rows, logits, at::kLong, "top_k");
  s.top_p_rows = rows_of<float>(top_p_rows, logits, at::kFloat, "top_p");
  s.min_p_rows = rows_of<float>(min_p_rows, logits, at::kFloat, "min_p");
  s.raw_c = rlkernel::log2e_over(temperature > 0.0 ? temperature : 1.0);  // the logp forward's scale (T = 0: T' = 1)
  return s;
}

void check_logits(const Tensor& logits, const char* op) {
  TORCH_CHECK(logits.is_cuda(), "rlkernel ", op, ": logits must be a CUDA tensor");
  TORCH_CHECK(logits.dim() == 2 && (logits.size(1) <= 1 || logits.stride(1) == 1), "rlkernel ", op,
              ": logits must be [N, V], last dim contiguous");
}

// The draw of sample and sample_processed: ids int64 [N] into `ids`, and (logp non-null) each drawn id's processed
// log-prob from the same kernels (float32 [N]; raw: the unfiltered one instead). A row without a distribution gets -1 (log-prob NaN) and is reported
// to the error record (error_*); a row whose per-row setting is out of range gets -1 (NaN) and a kErrOpBadArg
// entry. seeded: each row's noise comes from (seed, offset) (seed_rows / offset_rows per row), never from the
// generator, and not from the row's position.
void draw(const Tensor& logits, double temperature, int64_t top_k, double top_p,
          const std::optional<at::Generator>& generator, int64_t error_record, int64_t error_seq, double min_p,
          const std::optional<Tensor>& temperature_rows, const std::optional<Tensor>& top_k_rows,
          const std::optional<Tensor>& top_p_rows, const std::optional<Tensor>& min_p_rows, bool seeded,
          int64_t seed, const std::optional<Tensor>& seed_rows, int64_t offset,
          const std::optional<Tensor>& offset_rows, const Tensor& ids, float* logp, bool raw = false) {
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int device = logits.device().index();
  rlkernel::SampleSettings s =
      settings_of(logits, temperature, top_k, top_p, min_p, temperature_rows, top_k_rows, top_p_rows, min_p_rows);
  TORCH_CHECK(!(seeded && generator.has_value()), "rlkernel sample: a generator and seeds are exclusive");
  if (n == 0) return;
  const rlkernel::ErrorSink errors = rlkernel::error_sink(error_record, error_seq, rlkernel::kErrOpSampleNoDist);
  if (seeded) {
    s.seeded = true;
    s.seed = seed;
    s.offset = offset;
    s.seed_rows = rows_of<int64_t>(seed_rows, logits, at::kLong, "seed");
    s.offset_rows = rows_of<int64_t>(offset_rows, logits, at::kLong, "offset");
  } else if (temperature_rows.has_value() || s.temperature > 0.f) {
    // T = 0 for every row is argmax and draws nothing: the generator is left as it was
    s.generator = philox_args(generator, device, rlkernel::kSampleOffsetIncrement);
  }
  const size_t ws_bytes = rlkernel::sample_rows_workspace_bytes(n, vocab, s, raw);
  Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  const char* err = rlkernel::sample_rows_launch(
      logits.data_ptr(), rlkernel::elem_type_of(logits, "rlkernel sample"), n, vocab,
      n > 1 ? logits.stride(0) : vocab, s, ids.data_ptr<int64_t>(), logp, errors,
      ws_bytes ? ws.data_ptr() : nullptr, ws_bytes, rlkernel::current_cuda_stream(device), raw);
  TORCH_CHECK(err == nullptr, "rlkernel sample: ", err);
}

}  // namespace

namespace rlkernel::ops {

Tensor sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
              std::optional<at::Generator> generator, int64_t error_record, int64_t error_seq, double min_p,
              const std::optional<Tensor>& temperature_rows, const std::optional<Tensor>& top_k_rows,
              const std::optional<Tensor>& top_p_rows, const std::optional<Tensor>& min_p_rows, bool seeded,
              int64_t seed, const std::optional<Tensor>& seed_rows, int64_t offset,
              const std::optional<Tensor>& offset_rows) {
  check_logits(logits, "sample");
  c10::DeviceGuard guard(logits.device());
  Tensor ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  draw(logits, temperature, top_k, top_p, generator, error_record, error_seq, min_p, temperature_rows, top_k_rows,
       top_p_rows, min_p_rows, seeded, seed, seed_rows, offset, offset_rows, ids, nullptr);
  return ids;
}

std::tuple<Tensor, Tensor> sample_processed(
    const Tensor& logits, double temperature, int64_t top_k, double top_p, std::optional<at::Generator> generator,
    int64_t error_record, int64_t error_seq, double min_p, const std::optional<Tensor>& temperature_rows,
    const std::optional<Tensor>& top_k_rows, const std::optional<Tensor>& top_p_rows,
    const std::optional<Tensor>& min_p_rows, bool seeded, int64_t seed, const std::optional<Tensor>& seed_rows,
    int64_t offset, const std::optional<Tensor>& offset_rows, bool raw) {
  check_logits(logits, "sample");
  c10::DeviceGuard guard(logits.device());
  Tensor ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  Tensor logp = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  draw(logits, temperature, top_k, top_p, generator, error_record, error_seq, min_p, temperature_rows, top_k_rows,
       top_p_rows, min_p_rows, seeded, seed, seed_rows, offset, offset_rows, ids, logp.data_ptr<float>(), raw);
  return {ids, logp};
}

}  // namespace rlkernel::ops

namespace {

// The processed log-prob forward: (logp [N], entropy [N] or [0], stats [N, 4] float32, threshold [N] int64).
std::tuple<Tensor, Tensor, Tensor, Tensor> logp_processed_forward(
    const Tensor& logits, const Tensor& ids, double temperature, int64_t top_k, double top_p, double min_p,
    const std::optional<Tensor>& temperature_rows, const std::optional<Tensor>& top_k_rows,
    const std::optional<Tensor>& top_p_rows, const std::optional<Tensor>& min_p_rows, int64_t ignore_index,
    bool compute_entropy, int64_t error_record, int64_t error_seq, int64_t error_op,
    c10::string_view /*requested*/) {
  check_logits(logits, "logp_processed_forward");
  TORCH_CHECK(ids.device() == logits.device() && ids.scalar_type() == at::kLong && ids.dim() == 1 &&
                  ids.is_contiguous() && ids.size(0) == logits.size(0),
              "rlkernel: token_ids must be contiguous int64 [N]");
  c10::DeviceGuard guard(logits.device());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const rlkernel::SampleSettings s =
      settings_of(logits, temperature, top_k, top_p, min_p, temperature_rows, top_k_rows, top_p_rows, min_p_rows);
  auto f32 = logits.options().dtype(at::kFloat);
  Tensor logp = at::empty({n}, f32);
  Tensor entropy = at::empty({compute_entropy ? n : 0}, f32);
  Tensor stats = at::empty({n, 4}, f32);
  Tensor threshold = at::empty({n}, logits.options().dtype(at::kLong));
  if (n == 0) return {logp, entropy, stats, threshold};
  rlkernel::ProcessedOut out;
  out.ids = ids.data_ptr<int64_t>();
  out.ignore_index = ignore_index;
  out.logp = logp.data_ptr<float>();
  out.entropy = compute_entropy ? entropy.data_ptr<float>() : nullptr;
  out.stats = stats.data_ptr<float>();
  out.threshold = threshold.data_ptr<int64_t>();
  const size_t ws_bytes = rlkernel::sample_rows_workspace_bytes(n, vocab, s);
  Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  const char* err = rlkernel::logp_processed_forward_launch(
      logits.data_ptr(), rlkernel::elem_type_of(logits, "rlkernel logp"), n, vocab, n > 1 ? logits.stride(0) : vocab,
      s, out, rlkernel::error_sink(error_record, error_seq, error_op), ws_bytes ? ws.data_ptr() : nullptr, ws_bytes,
      rlkernel::current_cuda_stream(logits.device().index()));
  TORCH_CHECK(err == nullptr, "rlkernel logp_processed_forward: ", err);
  return {logp, entropy, stats, threshold};
}

Tensor logp_processed_backward(const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
                               const Tensor& logits, const Tensor& ids, const Tensor& stats, const Tensor& threshold,
                               int64_t ignore_index) {
  check_logits(logits, "logp_processed_backward");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == n &&
                  stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.numel() == 4 * n &&
                  threshold.scalar_type() == at::kLong && threshold.is_contiguous() && threshold.numel() == n,
              "rlkernel logp_processed_backward: ids, stats and threshold must be the forward's");
  auto row_grad = [&](const std::optional<Tensor>& g, int64_t* stride) -> const float* {
    *stride = 0;
    if (!g.has_value()) return nullptr;
    TORCH_CHECK(g->scalar_type() == at::kFloat && g->dim() == 1 && g->size(0) == n && g->device() == logits.device(),
                "rlkernel: row gradients must be float32 [N] on the logits' device");
    *stride = g->stride(0);
    return g->data_ptr<float>();
  };
  c10::DeviceGuard guard(logits.device());
  Tensor grad = at::empty({n, vocab}, logits.options());
  int64_t gl_stride = 0, gh_stride = 0;
  const float* gl = row_grad(grad_logp, &gl_stride);
  const float* gh = row_grad(grad_entropy, &gh_stride);
  const char* err = rlkernel::logp_processed_backward_launch(
      logits.data_ptr(), rlkernel::elem_type_of(logits, "rlkernel logp"), n, vocab, n > 1 ? logits.stride(0) : vocab,
      ids.data_ptr<int64_t>(), ignore_index, stats.data_ptr<float>(), threshold.data_ptr<int64_t>(), gl, gl_stride,
      gh, gh_stride, grad.data_ptr(), vocab, rlkernel::current_cuda_stream(logits.device().index()));
  TORCH_CHECK(err == nullptr, "rlkernel logp_processed_backward: ", err);
  return grad;
}

}  // namespace

// sample: the scalar settings first (as before), then min_p, the per-row settings (a tensor, when given, replaces
// its scalar) and the seeded mode. sample_processed: the same arguments and draw, and each drawn id's processed
// log-prob from the same kernels in the same pass (raw=True: its unfiltered log-prob, from the same pass too). The processed log-probs share the sampler's kernels
// (csrc/sampling.cu).
TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("sample(Tensor logits, float temperature, int top_k, float top_p, Generator? generator=None, "
        "int error_record=0, int error_seq=0, float min_p=0.0, Tensor? temperature_rows=None, "
        "Tensor? top_k_rows=None, Tensor? top_p_rows=None, Tensor? min_p_rows=None, bool seeded=False, int seed=0, "
        "Tensor? seed_rows=None, int offset=0, Tensor? offset_rows=None) -> Tensor ids");
  m.def("sample_processed(Tensor logits, float temperature, int top_k, float top_p, Generator? generator=None, "
        "int error_record=0, int error_seq=0, float min_p=0.0, Tensor? temperature_rows=None, "
        "Tensor? top_k_rows=None, Tensor? top_p_rows=None, Tensor? min_p_rows=None, bool seeded=False, int seed=0, "
        "Tensor? seed_rows=None, int offset=0, Tensor? offset_rows=None, bool raw=False) -> (Tensor ids, "
        "Tensor logprobs)");
  m.def("logp_processed_forward(Tensor logits, Tensor token_ids, float temperature, int top_k, float top_p, "
        "float min_p, Tensor? temperature_rows, Tensor? top_k_rows, Tensor? top_p_rows, Tensor? min_p_rows, "
        "int ignore_index, bool compute_entropy, int error_record=0, int error_seq=0, int error_op=1, "
        "str requested=\"fused\") -> (Tensor logp, Tensor entropy, Tensor stats, Tensor threshold)");
  m.def("logp_processed_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor token_ids, "
        "Tensor stats, Tensor threshold, int ignore_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlkernel, CUDA, m) {
  m.impl("sample", &rlkernel::ops::sample);
  m.impl("sample_processed", &rlkernel::ops::sample_processed);
  m.impl("logp_processed_forward", &logp_processed_forward);
  m.impl("logp_processed_backward", &logp_processed_backward);
}
