// The ops' C++ bodies that more than one entry calls: the registered torch op (csrc/logp_op.cpp, csrc/sampling_op.cpp)
// and the eager entry of the Python module (csrc/python_module.cpp), which skips torch's op dispatcher on the no-grad
// eager path. Torch-level, so it sits beside its includers in csrc/, not in the framework-free include/.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace rlkernel::ops {

// logp[N], entropy[N] (or [0]), stats[N, 2]: torch.ops.rlkernel.logp_forward without its autograd-only arguments.
std::tuple<at::Tensor, at::Tensor, at::Tensor> logp_forward_eager(const at::Tensor& logits, const at::Tensor& ids,
                                                                  double temperature, int64_t ignore_index,
                                                                  bool compute_entropy, int64_t error_record,
                                                                  int64_t error_seq, int64_t error_op);

// ids[N]: torch.ops.rlkernel.sample (csrc/sampling_op.cpp, which documents the arguments).
at::Tensor sample(const at::Tensor& logits, double temperature, int64_t top_k, double top_p,
                  std::optional<at::Generator> generator, int64_t error_record, int64_t error_seq, double min_p,
                  const std::optional<at::Tensor>& temperature_rows, const std::optional<at::Tensor>& top_k_rows,
                  const std::optional<at::Tensor>& top_p_rows, const std::optional<at::Tensor>& min_p_rows,
                  bool seeded, int64_t seed, const std::optional<at::Tensor>& seed_rows, int64_t offset,
                  const std::optional<at::Tensor>& offset_rows);

// (ids[N], processed log-probs[N] float32): torch.ops.rlkernel.sample_processed, the same arguments as sample; raw:
// the unfiltered log-probs instead (rlkernel.sample's return_logprobs=True), from the same pass.
std::tuple<at::Tensor, at::Tensor> sample_processed(
    const at::Tensor& logits, double temperature, int64_t top_k, double top_p, std::optional<at::Generator> generator,
    int64_t error_record, int64_t error_seq, double min_p, const std::optional<at::Tensor>& temperature_rows,
    const std::optional<at::Tensor>& top_k_rows, const std::optional<at::Tensor>& top_p_rows,
    const std::optional<at::Tensor>& min_p_rows, bool seeded, int64_t seed, const std::optional<at::Tensor>& seed_rows,
    int64_t offset, const std::optional<at::Tensor>& offset_rows, bool raw);

}  // namespace rlkernel::ops
