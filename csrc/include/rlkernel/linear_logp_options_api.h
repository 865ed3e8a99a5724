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
// tile [rows, cols] := softcap tanh(logit_scale tile / softcap), in place.
const char* linear_logp_softcap(void* tile, int64_t row_stride, int64_t rows, int64_t cols, ElemType dtype,
                                double softcap, double logit_scale, void* stream);

}  // namespace rlkernel
