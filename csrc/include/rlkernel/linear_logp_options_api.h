// Host interface of the launchers of rlkernel.linear_logp's option kernels (csrc/linear_logp_options.cu): a per-row
// temperature and the softcap (linear_logp_options_kernels.cuh). Plain C++, as linear_logp_api.h.
#pragma once

#include <cstdint>

#include "rlkernel/linear_logp_api.h"

namespace rlkernel {

// The fold of linear_logp_fold (args.temperature unused) with each row's temperature from row_t ([n_rows] float32,
// NaN: a bad row, NaN results; reported by the caller).
const char* linear_logp_fold_rows(const LinearFoldArgs& args, const float* row_t);
// The grad of linear_logp_grad (args.temperature unused) with row_t, and softcap > 0: the tile holds softcapped
// logits, the gradient is multiplied by logit_scale (1 - (x / softcap)^2).
const char* linear_logp_grad_rows(const LinearGradArgs& args, const float* row_t, double softcap,
                                  double logit_scale);
// The statistics of linear_logp's `outputs` (issue 31), written by fold_extras beside the fold's.
struct LinearExtrasArgs {
  float* xstate;      // [4 n_rows] running state between chunks
  float* log_sum_sq;  // [n_rows] log sum_j p_j^2
  float* mean_logit;  // [n_rows] mean_j z'_j
  bool* is_top1;      // [n_rows] the id is z''s first argmax (ties: the lowest column)
};
// linear_logp_fold_rows plus those statistics, in the same launch (vocab < 2^31: the argmax column is an int).
const char* linear_logp_fold_extras(const LinearFoldArgs& args, const float* row_t, const LinearExtrasArgs& extras);
// tile [rows, cols] := softcap tanh(logit_scale tile / softcap), in place.
const char* linear_logp_softcap(void* tile, int64_t row_stride, int64_t rows, int64_t cols, ElemType dtype,
                                double softcap, double logit_scale, void* stream);

}  // namespace rlkernel
