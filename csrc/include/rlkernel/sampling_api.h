// Host-side interface of the fused sampler (csrc/sampling.cu). Plain C++: csrc/sampling_op.cpp includes it without
// the CUDA compiler, and nothing here includes torch (the kernels' sampling_common.cuh includes it too).
#pragma once

#include <cstddef>
#include <cstdint>

#include "rlkernel/common_api.h"  // ElemType
#include "rlkernel/error_record.h"

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

// The settings of one call, each a value for every row or (pointer non-null) one value per row in device memory
// (read by the kernels, never by the host). A per-row value out of range is checked on the device: the row's id is
// -1 (log-prob NaN) and the error record gets kind kErrOpBadArg with the argument's code (kArg*) and the row.
struct SampleSettings {
  float temperature = 1.f;               // 0 = argmax
  int64_t top_k = 0;                     // 0 or >= vocab = all
  double top_p = 1.0;                    // 1 = all
  float min_p = 0.f;                     // 0 = all
  const float* temperature_rows = nullptr;
  const int64_t* top_k_rows = nullptr;
  const float* top_p_rows = nullptr;
  const float* min_p_rows = nullptr;
  // the noise: a generator's Philox state (counter word 1 = the row), or (seeded) each row's own seed and offset
  // with counter word 1 = 0, so a row's draw does not depend on the batch around it
  PhiloxArgs generator;
  bool seeded = false;
  int64_t seed = 0, offset = 0;
  const int64_t* seed_rows = nullptr;
  const int64_t* offset_rows = nullptr;
  // raw log-probs (sample_rows_launch with raw_logp): log2(e) / T' of the scalar temperature as the logp forward
  // rounds it (log2e_over of the double, T' = 1 where T = 0), so its scale is that kernel's bit for bit; a per-row
  // temperature's rows take __fdiv_rn(log2(e), T') of their float T instead
  float raw_c = 1.4426950408889634f;
};

// Argument codes of kErrOpBadArg entries (rlkernel/errors.py names them).
constexpr int kArgTemperature = 0, kArgTopK = 1, kArgTopP = 2, kArgMinP = 3;

// Where the processed log-prob forward writes (instead of drawing): per row, for the id ids[row], its log-prob under
// the filtered, renormalised law (-inf outside the kept set), the entropy of that law (optional), the row's stats
// (s_max, log S, H, 1/T; 1/T = 0 for an argmax row) and the kept set's threshold: token j is kept iff
// (key(s_j) << 32 | (2^32 - 1 - j)) >= threshold, as unsigned 64-bit (stored as int64 bits).
struct ProcessedOut {
  const int64_t* ids = nullptr;
  int64_t ignore_index = -100;
  float* logp = nullptr;
  float* entropy = nullptr;  // nullptr: none
  float* stats = nullptr;    // [rows, 4]
  int64_t* threshold = nullptr;
};

// Bytes of device workspace the launches below need (the fast path's candidates; 0 if none). Depends on the
// scalar settings and on which are per row, never on per-row values.
size_t sample_workspace_bytes(int64_t rows, int64_t vocab, float temperature, int64_t top_k);
size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab, const SampleSettings& s, bool raw_logp = false);

// Draw one id per row into ids[rows] (int64). logits: rows x vocab, row i at logits + i * row_stride
// elements, unit stride inside a row. temperature 0 = argmax. top_k 0 = all, top_p 1 = all.
// A row with a NaN, with no logit above -inf, or (temperature > 0) whose largest scaled logit is +inf has no
// distribution: its id is -1 and the row is reported to `errors` (the device's error record, error_record.h).
// Puts on `stream`, inside the NVTX range rlkernel:op.sample, rlkernel_* kernels only, nothing else.
// Returns nullptr on success, else the error's text. rows * ceil(vocab / 8192) must be < 2^31, vocab < 2^31.
const char* sample_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                          float temperature, int64_t top_k, double top_p, const PhiloxArgs& rng, int64_t* ids,
                          const ErrorSink& errors, void* workspace, size_t workspace_bytes, void* stream);

// The same with per-row settings, min_p and seeds (SampleSettings). logp non-null: also each drawn id's processed
// log-prob (float32 [rows]; NaN where the id is -1) from the same kernels in the same pass (no second read of the
// logits), bitwise what logp_processed_forward_launch gives for that id with the same settings: the kept set's
// mass is summed by the same integer code, and the log-prob is the same expression of it (sampling_filter.cuh).
// raw_logp (with logp): instead the drawn id's unfiltered log-prob under softmax(logits / T') (T' = T, 1 where
// T = 0), from the same kernels too: the row's max and sum of exponentials come from the candidates kernel's
// per-chunk states (the fast path) or from the logp forward's own row reduction run by the whole-row path's block
// (docs/contracts.md, section 1: the bound against the logp forward). The workspace is then
// sample_rows_workspace_bytes(..., true).
const char* sample_rows_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                               const SampleSettings& settings, int64_t* ids, float* logp, const ErrorSink& errors,
                               void* workspace, size_t workspace_bytes, void* stream, bool raw_logp = false);

// The processed log-prob forward: the sampler's own filter code finds each row's kept set (so the sampler and this
// agree bit for bit), then writes ProcessedOut. Bad ids (outside [0, vocab), not ignore_index) give NaN and go to
// `errors` (its op); bad per-row settings give NaN and a kErrOpBadArg entry. Inside the NVTX range
// rlkernel:op.logp.forward. The noise fields of `settings` are ignored.
const char* logp_processed_forward_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab,
                                          int64_t row_stride, const SampleSettings& settings,
                                          const ProcessedOut& out, const ErrorSink& errors, void* workspace,
                                          size_t workspace_bytes, void* stream);

// Its backward: grad[rows, vocab] (dtype of the logits, row stride grad_row_stride) = on the kept set
// (1/T) (g_l (onehot - q) - g_H q (log q + H)), 0 elsewhere; no g_l term on a row whose id is not kept; 0 on
// ignored and argmax rows, NaN on rows the forward marked bad. Inside rlkernel:op.logp.backward.
const char* logp_processed_backward_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab,
                                           int64_t row_stride, const int64_t* ids, int64_t ignore_index,
                                           const float* stats, const int64_t* threshold, const float* grad_logp,
                                           int64_t grad_logp_stride, const float* grad_entropy,
                                           int64_t grad_entropy_stride, void* grad, int64_t grad_row_stride,
                                           void* stream);

}  // namespace rlkernel
