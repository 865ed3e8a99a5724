// What every op's host interface shares (logp_api.h, linear_logp_api.h, sampling_api.h, and the op files): the
// element type, the row-gradient fields and the current stream. Plain C++: no CUDA or torch header, so that the op
// registration files compile with the CPU torch wheel alone. Streams travel as void* (a cudaStream_t).
#pragma once

#include <cstdint>

namespace rlkernel {

enum class ElemType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// What a row's gradient needs besides its logits: the same fields, and meaning, in the logp backward
// (LogpBackwardArgs, logp_api.h) and the linear-logp grad (LinearGradArgs, linear_logp_api.h), whose launchers pass
// them on to the kernels' shared RowGradInputs (row_grad.cuh) in one place.
struct RowGradArgs {
  ElemType dtype;
  double temperature;
  int64_t ignore_index;
  const float* grad_logp;   // [n_rows] with stride, or nullptr
  int64_t grad_logp_stride;
  const float* grad_entropy;  // [n_rows] with stride, or nullptr
  int64_t grad_entropy_stride;
  const float* entropy;     // forward entropy, needed with grad_entropy
  const float* stats;       // [n_rows, 2] from the forward
};

// log2(e) / T, the row kernels' scale of the logits (base-2 units), rounded once from double: the logp forward's and
// the sampler's raw log-probs' (sampling_api.h, SampleSettings::raw_c) one expression, so their scales agree bit for
// bit.
inline float log2e_over(double temperature) { return static_cast<float>(1.4426950408889634 / temperature); }

// Current CUDA stream of a device, from torch (csrc/cuda_stream.cpp: the one file built with torch's CUDA headers).
void* current_cuda_stream(int device_index);

}  // namespace rlkernel
