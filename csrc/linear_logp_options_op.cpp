// Registration of rlkernel.linear_logp's option ops (a per-row temperature, the softcap, the statistics of
// `outputs`): schemas, thin tensor checks, calls into csrc/linear_logp_options.cu. torch/library.h-level headers only
// (the CI compile gate builds this with the CPU wheel). The GEMMs, the workspace and autograd live in Python
// (rlkernel/ops/fused/linear_logp.py).
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "rlkernel/linear_logp_options_api.h"
#include "linear_logp_checks.h"
#include "torch_elem_type.h"

namespace {

using at::Tensor;

using namespace rlkernel::linear_logp_checks;  // kOp, check_tile, check_f32, check_ids, optional_rows, ...

template <class Args>
void fill_tile(Args& a, const Tensor& tile, const Tensor& ids, int64_t n, int64_t col0, int64_t vocab,
               int64_t ignore_index) {
  a.tile = tile.data_ptr();
  a.row_stride = tile.stride(0);
  a.ids = ids.data_ptr<int64_t>();
  a.n_rows = n;
  a.cols = tile.size(1);
  a.col0 = col0;
  a.vocab = vocab;
  a.dtype = rlkernel::elem_type_of(tile, kOp);
  a.temperature = 1.0;  // per row
  a.ignore_index = ignore_index;
  a.stream = rlkernel::current_cuda_stream(tile.device().index());
}

// The fold's arguments, checked (fold_rows and fold_extras).
rlkernel::LinearFoldArgs fold_args(const Tensor& tile, const Tensor& ids, const Tensor& row_t, Tensor& state,
                                   Tensor& logp, Tensor& entropy, Tensor& stats, int64_t col0, int64_t vocab,
                                   int64_t ignore_index, bool first, bool last, int64_t row0, int64_t error_record,
                                   int64_t error_seq) {
  check_tile(tile);
  const int64_t n = tile.size(0);
  check_ids(ids, n, tile);
  check_f32(row_t, n, tile, "row_t");
  check_f32(state, 4 * n, tile, "state");
  check_f32(logp, n, tile, "logp");
  check_f32(stats, 2 * n, tile, "stats");
  const bool with_entropy = entropy.numel() > 0;
  if (with_entropy) check_f32(entropy, n, tile, "entropy");
  TORCH_CHECK(col0 >= 0 && col0 + tile.size(1) <= vocab, kOp, ": chunk outside the vocabulary");
  rlkernel::LinearFoldArgs a{};
  fill_tile(a, tile, ids, n, col0, vocab, ignore_index);
  a.state = state.data_ptr<float>();
  a.first = first;
  a.last = last;
  a.logp = logp.data_ptr<float>();
  a.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  a.stats = stats.data_ptr<float>();
  a.row0 = row0;
  a.errors = rlkernel::error_sink(error_record, error_seq, rlkernel::kErrOpLogpBadId);
  return a;
}

// linear_logp_fold with each row's temperature from row_t (float32 [n]; NaN: a bad row).
void fold_rows(const Tensor& tile, const Tensor& ids, const Tensor& row_t, Tensor& state, Tensor& logp,
               Tensor& entropy, Tensor& stats, int64_t col0, int64_t vocab, int64_t ignore_index, bool first,
               bool last, int64_t row0, int64_t error_record, int64_t error_seq) {
  c10::DeviceGuard guard(tile.device());
  const auto a = fold_args(tile, ids, row_t, state, logp, entropy, stats, col0, vocab, ignore_index, first, last, row0,
                           error_record, error_seq);
  const char* err = rlkernel::linear_logp_fold_rows(a, row_t.data_ptr<float>());
  TORCH_CHECK(err == nullptr, kOp, " fold_rows: ", err);
}

// fold_rows plus the statistics of `outputs`: xstate float32 [4n] (between chunks), log_sum_sq and mean_logit
// float32 [n], is_top1 bool [n].
void fold_extras(const Tensor& tile, const Tensor& ids, const Tensor& row_t, Tensor& state, Tensor& xstate,
                 Tensor& logp, Tensor& entropy, Tensor& stats, Tensor& log_sum_sq, Tensor& mean_logit,
                 Tensor& is_top1, int64_t col0, int64_t vocab, int64_t ignore_index, bool first, bool last,
                 int64_t row0, int64_t error_record, int64_t error_seq) {
  c10::DeviceGuard guard(tile.device());
  const auto a = fold_args(tile, ids, row_t, state, logp, entropy, stats, col0, vocab, ignore_index, first, last, row0,
                           error_record, error_seq);
  const int64_t n = a.n_rows;
  check_f32(xstate, 4 * n, tile, "xstate");
  check_f32(log_sum_sq, n, tile, "log_sum_sq");
  check_f32(mean_logit, n, tile, "mean_logit");
  TORCH_CHECK(is_top1.scalar_type() == at::kBool && is_top1.is_contiguous() && is_top1.numel() == n &&
              is_top1.device() == tile.device(), kOp, ": is_top1 must be contiguous bool with ", n,
              " elements on the tile's device");
  TORCH_CHECK(vocab < INT32_MAX, kOp, ": outputs need a vocabulary below 2^31 - 1 columns");
  const rlkernel::LinearExtrasArgs x{xstate.data_ptr<float>(), log_sum_sq.data_ptr<float>(),
                                     mean_logit.data_ptr<float>(), is_top1.data_ptr<bool>()};
  const char* err = rlkernel::linear_logp_fold_extras(a, row_t.data_ptr<float>(), x);
  TORCH_CHECK(err == nullptr, kOp, " fold_extras: ", err);
}

// linear_logp_grad_tile with row_t, and softcap > 0: the tile holds softcapped (float32) logits.
void grad_rows(Tensor& tile, const Tensor& ids, const Tensor& row_t, const Tensor& stats,
               const std::optional<Tensor>& grad_logp, const std::optional<Tensor>& grad_entropy,
               const Tensor& entropy, int64_t col0, int64_t vocab, int64_t ignore_index, double softcap,
               double logit_scale) {
  check_tile(tile);
  const int64_t n = ids.numel();
  TORCH_CHECK(n <= tile.size(0), kOp, ": more ids than tile rows");
  check_ids(ids, n, tile);
  check_f32(row_t, n, tile, "row_t");
  TORCH_CHECK(softcap <= 0.0 || tile.scalar_type() == at::kFloat, kOp, ": a softcapped tile must be float32");
  c10::DeviceGuard guard(tile.device());
  rlkernel::LinearGradArgs a{};
  fill_tile(a, tile, ids, n, col0, vocab, ignore_index);
  a.tile_rows = tile.size(0);
  fill_row_grads(a, grad_logp, grad_entropy, entropy, stats, n, tile);
  const char* err = rlkernel::linear_logp_grad_rows(a, row_t.data_ptr<float>(), softcap, logit_scale);
  TORCH_CHECK(err == nullptr, kOp, " grad_rows: ", err);
}

// tile := softcap tanh(logit_scale tile / softcap), in place.
void softcap_tile(Tensor& tile, double softcap, double logit_scale) {
  check_tile(tile);
  TORCH_CHECK(softcap > 0.0, kOp, ": softcap must be > 0");
  c10::DeviceGuard guard(tile.device());
  const char* err = rlkernel::linear_logp_softcap(tile.data_ptr(), tile.stride(0), tile.size(0), tile.size(1),
                                                  rlkernel::elem_type_of(tile, kOp), softcap, logit_scale,
                                                  rlkernel::current_cuda_stream(tile.device().index()));
  TORCH_CHECK(err == nullptr, kOp, " softcap: ", err);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("linear_logp_fold_rows(Tensor tile, Tensor token_ids, Tensor row_t, Tensor(a!) state, Tensor(b!) logp, "
        "Tensor(c!) entropy, Tensor(d!) stats, int col0, int vocab, int ignore_index, bool first, bool last, "
        "int row0=0, int error_record=0, int error_seq=0) -> ()");
  m.def("linear_logp_fold_extras(Tensor tile, Tensor token_ids, Tensor row_t, Tensor(a!) state, Tensor(b!) xstate, "
        "Tensor(c!) logp, Tensor(d!) entropy, Tensor(e!) stats, Tensor(f!) log_sum_sq, Tensor(g!) mean_logit, "
        "Tensor(h!) is_top1, int col0, int vocab, int ignore_index, bool first, bool last, int row0=0, "
        "int error_record=0, int error_seq=0) -> ()");
  m.def("linear_logp_grad_rows(Tensor(a!) tile, Tensor token_ids, Tensor row_t, Tensor stats, Tensor? grad_logp, "
        "Tensor? grad_entropy, Tensor entropy, int col0, int vocab, int ignore_index, float softcap, "
        "float logit_scale) -> ()");
  m.def("linear_logp_softcap(Tensor(a!) tile, float softcap, float logit_scale) -> ()");
}

TORCH_LIBRARY_IMPL(rlkernel, CUDA, m) {
  m.impl("linear_logp_fold_rows", &fold_rows);
  m.impl("linear_logp_fold_extras", &fold_extras);
  m.impl("linear_logp_grad_rows", &grad_rows);
  m.impl("linear_logp_softcap", &softcap_tile);
}
