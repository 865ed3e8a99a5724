// Host interface of the log-prob launchers (csrc/logp.cu). Plain C++: no CUDA or torch header, so that
// csrc/logp_op.cpp compiles with the CPU torch wheel alone. Streams travel as void* (a cudaStream_t).
#pragma once

#include <cstdint>

#include "rlkernel/common_api.h"  // ElemType, RowGradArgs, current_cuda_stream
#include "rlkernel/error_record.h"

namespace rlkernel {

struct LogpForwardArgs {
  const void* logits;       // [n_rows, vocab], last dim contiguous, any row stride (elements) and alignment
  int64_t row_stride;
  const int64_t* ids;       // [n_rows], contiguous
  int64_t n_rows;
  int64_t vocab;
  ElemType dtype;
  double temperature;       // > 0
  int64_t ignore_index;
  float* logp;              // [n_rows]
  float* entropy;           // [n_rows], or nullptr for no entropy
  float* stats;             // [n_rows, 2]: (r, log2 s) in base-2 units of x / T
  ErrorSink errors;         // rows with an id outside [0, vocab) (not ignore_index) are reported here
  void* stream;
};

struct LogpBackwardArgs : RowGradArgs {
  const void* logits;
  int64_t row_stride;
  void* grad;               // [n_rows, vocab] of dtype; may be logits itself (in place)
  int64_t grad_row_stride;
  const int64_t* ids;
  int64_t n_rows;
  int64_t vocab;
  void* stream;
};

// Each returns nullptr on success, else a static message (a CUDA error string).
const char* logp_forward(const LogpForwardArgs& args);
const char* logp_backward(const LogpBackwardArgs& args);

// The device's row team for vocab size V: the number of threads that reduce one row (see row_reduce.cuh).
int logp_row_team(int64_t vocab, ElemType dtype);

}  // namespace rlkernel
