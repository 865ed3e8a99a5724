// Host-side interface of the fused sampler (csrc/sampling.cu). Plain C++: csrc/bindings.cpp
// includes it without the CUDA compiler, and nothing here includes torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rlkernel/logp_api.h"  // ElemType

namespace rlkernel {

// The generator's Philox state for one call, as torch's at::PhiloxCudaState carries it: values, or (inside
// CUDA-graph capture) pointers the graph's replays update, plus this call's offset within the graph.
struct PhiloxArgs {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  bool captured = false;
};

// How far one call advances the generator's offset (torch asks for multiples of 4). Each call's counters
// carry its offset, so calls never share random numbers.
constexpr uint64_t kSampleOffsetIncrement = 4;

// Bytes of device workspace sample_launch needs for these arguments (the fast path's candidates; 0 if none).
size_t sample_workspace_bytes(int64_t rows, int64_t vocab, float temperature, int64_t top_k);

// Draw one id per row into ids[rows] (int64). logits: rows x vocab, row i at logits + i * row_stride
// elements, unit stride inside a row. temperature 0 = argmax. top_k 0 = all, top_p 1 = all.
// A row with a NaN, with no logit above -inf, or (temperature > 0) whose largest scaled logit is +inf has no
// distribution: its id is -1 and the row is reported to `errors` (the device's error record, error_record.h).
// Puts on `stream`, inside the NVTX range rlkernel:op.sample, rlkernel_* kernels only, nothing else.
// Returns nullptr on success, else the error's text. rows * ceil(vocab / 8192) must be < 2^31, vocab < 2^31.
const char* sample_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                          float temperature, int64_t top_k, double top_p, const PhiloxArgs& rng, int64_t* ids,
                          const ErrorSink& errors, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace rlkernel
