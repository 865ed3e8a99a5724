// The tensor checks the fused LM-head ops share (csrc/linear_logp_op.cpp, csrc/linear_logp_options_op.cpp):
// torch/library.h-level headers only, as those files (the CI compile gate builds them with the CPU wheel).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "rlkernel/common_api.h"  // RowGradArgs

namespace rlkernel::linear_logp_checks {

using at::Tensor;

constexpr const char* kOp = "rlkernel linear_logp";

inline void check_tile(const Tensor& tile) {
  TORCH_CHECK(tile.is_cuda(), kOp, ": the tile must be a CUDA tensor");
  TORCH_CHECK(tile.dim() == 2 && (tile.size(1) <= 1 || tile.stride(1) == 1),
              kOp, ": the tile must be [rows, cols] with a contiguous last dim");
  TORCH_CHECK(tile.size(0) < (int64_t{1} << 31) && tile.size(1) < (int64_t{1} << 31), kOp, ": tile too large");
}

inline void check_f32(const Tensor& t, int64_t numel, const Tensor& like, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel && t.device() == like.device(),
              kOp, ": ", what, " must be contiguous float32 with ", numel, " elements on the tile's device");
}

inline void check_ids(const Tensor& ids, int64_t n, const Tensor& like) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() && ids.size(0) == n &&
              ids.device() == like.device(), kOp, ": token_ids must be contiguous int64 [", n, "]");
}

inline const float* optional_rows(const std::optional<Tensor>& g, int64_t n, const Tensor& like, int64_t* stride) {
  *stride = 0;
  if (!g.has_value()) return nullptr;
  TORCH_CHECK(g->scalar_type() == at::kFloat && g->dim() == 1 && g->size(0) == n && g->device() == like.device(),
              kOp, ": row gradients must be float32 [N] on the tile's device");
  *stride = g->stride(0);
  return g->data_ptr<float>();
}

// The rows' gradient inputs of the backward ops (RowGradArgs: g_l, g_H and the forward's entropy and stats), each
// checked against n rows on like's device.
inline void fill_row_grads(RowGradArgs& a, const std::optional<Tensor>& grad_logp,
                           const std::optional<Tensor>& grad_entropy, const Tensor& entropy, const Tensor& stats,
                           int64_t n, const Tensor& like) {
  check_f32(stats, 2 * n, like, "stats");
  a.grad_logp = optional_rows(grad_logp, n, like, &a.grad_logp_stride);
  a.grad_entropy = optional_rows(grad_entropy, n, like, &a.grad_entropy_stride);
  if (a.grad_entropy != nullptr) {
    check_f32(entropy, n, like, "entropy");
    a.entropy = entropy.data_ptr<float>();
  }
  a.stats = stats.data_ptr<float>();
}

}  // namespace rlkernel::linear_logp_checks
