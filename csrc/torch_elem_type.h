// The kernels' element type of a torch tensor, for the op files (logp_op.cpp, sampling_op.cpp, linear_logp_op.cpp).
// torch/library.h-level headers only: the CI compile gate builds its includers with the CPU torch wheel. Torch-level,
// so it sits beside its includers in csrc/, not in the framework-free include/.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "rlkernel/common_api.h"  // ElemType

namespace rlkernel {

// op: the message prefix of the error for any other dtype (Python validates first; this is the backstop).
inline ElemType elem_type_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return ElemType::kFloat32;
    case at::kHalf: return ElemType::kFloat16;
    case at::kBFloat16: return ElemType::kBFloat16;
    default: TORCH_CHECK(false, op, ": logits dtype ", t.scalar_type(), " unsupported (float16/bfloat16/float32)");
  }
}

}  // namespace rlkernel
