// The registered op rlkernel::sample (schema, thin tensor checks, the call into csrc/sampling.cu) and its
// randomness: the Philox state of a CUDA generator for one call, advanced as torch's own random kernels advance
// it (philox_cuda_state), so seeded calls reproduce and CUDA-graph replays draw afresh. The fake kernel and
// input validation live in Python (rlkernel/ops/sampling_fused.py, rlkernel/validate.py).
// Headers: CUDAGeneratorImpl.h also ships with the CPU wheel, so this file compiles there too (no link).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <tuple>

#include "rlkernel/logp_api.h"  // current_cuda_stream (csrc/cuda_stream.cpp)
#include "rlkernel/sampling_api.cuh"
#include "rlkernel/torch_elem_type.h"

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

// Returns ids int64 [N]; a row without a distribution gets -1 and is reported to the error record (error_*).
Tensor sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
              std::optional<at::Generator> generator, int64_t error_record, int64_t error_seq) {
  TORCH_CHECK(logits.is_cuda(), "rlkernel sample: logits must be a CUDA tensor");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "rlkernel sample: logits must be [N, V], last dim contiguous");
  TORCH_CHECK(temperature >= 0.0 && top_k >= 0 && top_p > 0.0 && top_p <= 1.0,
              "rlkernel sample: need temperature >= 0, top_k >= 0, 0 < top_p <= 1");
  c10::DeviceGuard guard(logits.device());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int device = logits.device().index();
  Tensor ids = at::empty({n}, logits.options().dtype(at::kLong));
  if (n == 0) return ids;
  const rlkernel::ErrorSink errors = rlkernel::error_sink(error_record, error_seq, rlkernel::kErrOpSampleNoDist);
  const float t = static_cast<float>(temperature);
  // T = 0 is argmax and draws nothing: the generator is left as it was
  const rlkernel::PhiloxArgs rng = t > 0.f ? philox_args(generator, device, rlkernel::kSampleOffsetIncrement)
                                           : rlkernel::PhiloxArgs{};
  const size_t ws_bytes = rlkernel::sample_workspace_bytes(n, vocab, t, top_k);
  Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  const char* err = rlkernel::sample_launch(
      logits.data_ptr(), rlkernel::elem_type_of(logits, "rlkernel sample"), n, vocab,
      n > 1 ? logits.stride(0) : vocab, t, top_k, top_p, rng, ids.data_ptr<int64_t>(), errors,
      ws_bytes ? ws.data_ptr() : nullptr, ws_bytes, rlkernel::current_cuda_stream(device));
  TORCH_CHECK(err == nullptr, "rlkernel sample: ", err);
  return ids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("sample(Tensor logits, float temperature, int top_k, float top_p, Generator? generator=None, "
        "int error_record=0, int error_seq=0) -> Tensor ids");
}

TORCH_LIBRARY_IMPL(rlkernel, CUDA, m) { m.impl("sample", &sample); }
