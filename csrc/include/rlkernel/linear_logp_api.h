// Host interface of the fused LM-head log-prob launchers (csrc/linear_logp.cu). Plain C++: no CUDA or torch
// header, so csrc/linear_logp_op.cpp compiles with the CPU torch wheel alone. Streams travel as void*.
// The GEMMs of the op are cuBLAS calls made by rlkernel/ops/fused/linear_logp.py; these launch the rest.
#pragma once

#include <cstdint>

#include "rlkernel/error_record.h"
#include "rlkernel/common_api.h"  // ElemType, RowGradArgs, current_cuda_stream

namespace rlkernel {

struct LinearFoldArgs {
  const void* tile;          // [n_rows, cols] logits of one vocabulary chunk, last dim contiguous
  int64_t row_stride;
  const int64_t* ids;        // [n_rows], contiguous
  int64_t n_rows;
  int64_t cols;
  int64_t col0;              // first vocabulary column of the chunk
  int64_t vocab;             // the whole vocabulary (bad ids: outside [0, vocab))
  ElemType dtype;
  double temperature;
  int64_t ignore_index;
  float* state;              // [n_rows, 4] running (m, s, t, x_target)
  bool first, last;          // the first / last chunk of the row block
  float* logp;               // [n_rows] (written by the last chunk)
  float* entropy;            // [n_rows], or nullptr for no entropy
  float* stats;              // [n_rows, 2]
  int64_t row0;              // first row of the block in the call (positions in the error record)
  ErrorSink errors;
  void* stream;
};

struct LinearGradArgs : RowGradArgs {  // dtype, T, ignore_index and the rows' g_l, g_H, entropy, stats
  void* tile;                // [tile_rows, cols], overwritten by the logits' gradient (unless `out`)
  int64_t row_stride;
  const int64_t* ids;        // [n_rows]
  int64_t n_rows;
  int64_t tile_rows;         // >= n_rows: rows past n_rows are padding and get 0
  int64_t cols;
  int64_t col0;
  int64_t vocab;
  void* stream;
  // Optional (nullptr: in place): with a float32 tile, the gradient goes, rounded once to out_dtype (bfloat16 or
  // float16), to out [tile_rows, cols] (row stride out_stride, last dim contiguous) and the tile is only read.
  void* out;
  int64_t out_stride;
  ElemType out_dtype;
};

// The epilogue GEMM (csrc/linear_logp_epilogue.cu, issue 37): hidden @ weight^T on Hopper with the softmax folded
// into the GEMM's epilogue (no logits tile), then the merge into logp / entropy / stats.
struct LinearEpilogueArgs {
  const void* hidden;        // [n_rows, hidden_size], row stride hidden_stride, 16-byte aligned
  int64_t hidden_stride;
  const void* weight;        // [vocab, hidden_size] contiguous, 16-byte aligned
  const void* bias;          // [vocab] or nullptr
  const int64_t* ids;        // [n_rows]
  int64_t n_rows;
  int64_t hidden_size;
  int64_t vocab;
  ElemType dtype;            // bfloat16 or float16
  double temperature;
  int64_t ignore_index;
  float* partial;            // [n_rows, linear_logp_epilogue_tiles(vocab, config), 4] float32 scratch
  float* logp;               // [n_rows]
  float* entropy;            // [n_rows], or nullptr for no entropy
  float* stats;              // [n_rows, 2]
  int64_t row0;              // first row in the call (positions in the error record)
  ErrorSink errors;
  int config;                // 0: cooperative 128 x 256 tiles; 1: ping-pong 128 x 128; 2: 0 in 2 x 1 clusters
                             // (1 and 2: bfloat16 only)
  int device;
  void* stream;
};

// The epilogue GEMM's backward of one vocabulary chunk (linear_logp; linear_logp_loss: a token chunk over the whole
// vocabulary, col0 = 0): the logits' gradient of hidden @ weight_chunk^T (+ bias), from the forward's stats, rounded
// once to the inputs' dtype into out; no logits tile. Rows past n_rows are padding (gradient 0).
struct LinearGradEpilogueArgs : RowGradArgs {  // dtype (bfloat16 / float16), T, ignore_index, g_l, g_H, entropy, stats
  const void* hidden;        // [tile_rows, hidden_size], row stride hidden_stride, 16-byte aligned
  int64_t hidden_stride;
  const void* weight;        // [cols, hidden_size]: the chunk's rows of the weight, contiguous, 16-byte aligned
  const void* bias;          // [cols] (the chunk's) or nullptr
  const int64_t* ids;        // [n_rows]
  int64_t n_rows;
  int64_t tile_rows;         // >= n_rows
  int64_t hidden_size;
  int64_t cols;
  int64_t col0;              // the chunk's first vocabulary column
  int64_t vocab;             // the whole vocabulary
  void* out;                 // [tile_rows, cols] of dtype, row stride out_stride, last dim contiguous
  int64_t out_stride;
  int config;                // as LinearEpilogueArgs::config
  int device;
  void* stream;
};

// Each returns nullptr on success, else a static message.
const char* linear_logp_fold(const LinearFoldArgs& args);
const char* linear_logp_grad(const LinearGradArgs& args);
// The epilogue GEMM: false where rlkernel._C was built without CUTLASS (then linear_logp_epilogue only refuses).
bool linear_logp_epilogue_built();
int64_t linear_logp_epilogue_tile_n(int config);             // vocabulary columns per partial
int64_t linear_logp_epilogue_tiles(int64_t vocab, int config);  // partials per row
const char* linear_logp_epilogue(const LinearEpilogueArgs& args);
const char* linear_logp_grad_epilogue(const LinearGradEpilogueArgs& args);
// out[c] (+)= sum over rows of tile[r, c] (float32), deterministic; partial: [linear_logp_colsum_blocks(n_rows), cols].
int64_t linear_logp_colsum_blocks(int64_t n_rows);
const char* linear_logp_colsum(const void* tile, int64_t row_stride, int64_t n_rows, int64_t cols, ElemType dtype,
                               float* partial, float* out, bool accumulate, void* stream);
// dst[i] = src[i] (accumulate: dst[i] += src[i]), i < n; src float32 or of dtype dst_dtype (src_is_float says
// which).
const char* linear_logp_cast(const void* src, bool src_is_float, void* dst, ElemType dst_dtype, int64_t n,
                             bool accumulate, void* stream);
// dst [rows, cols] contiguous: every row = bias [cols].
const char* linear_logp_bias_rows(const void* bias, void* dst, int64_t rows, int64_t cols, ElemType dtype,
                                  void* stream);
// dst [dst_rows, cols] = src rows (row stride src_stride) then zero rows.
const char* linear_logp_pack(const void* src, int64_t src_stride, int64_t rows, int64_t cols, ElemType dtype,
                             void* dst, int64_t dst_rows, void* stream);

}  // namespace rlkernel
