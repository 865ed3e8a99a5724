// Registration of the fused LM-head log-prob ops (rlkernel.linear_logp): schemas, thin tensor checks, calls into
// csrc/linear_logp.cu. torch/library.h-level headers only (the CI compile gate builds this with the CPU wheel).
// The GEMMs, the workspace and autograd live in Python (rlkernel/ops/fused/linear_logp.py); these ops launch only
// rlkernel_* kernels and never allocate.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>

#include "rlkernel/linear_logp_api.h"
#include "linear_logp_checks.h"
#include "torch_elem_type.h"

namespace {

using at::Tensor;

using namespace rlkernel::linear_logp_checks;  // kOp, check_tile, check_f32, check_ids, optional_rows, ...

// The fields LinearFoldArgs and LinearGradArgs share (same names, same meaning): the tile and its rows' ids, the
// chunk's place in the vocabulary, T, ignore_index and the stream. n: the rows with an id.
template <class Args>
void fill_tile(Args& a, const Tensor& tile, const Tensor& ids, int64_t n, int64_t col0, int64_t vocab,
               double temperature, int64_t ignore_index) {
  a.tile = tile.data_ptr();
  a.row_stride = tile.stride(0);
  a.ids = ids.data_ptr<int64_t>();
  a.n_rows = n;
  a.cols = tile.size(1);
  a.col0 = col0;
  a.vocab = vocab;
  a.dtype = rlkernel::elem_type_of(tile, kOp);
  a.temperature = temperature;
  a.ignore_index = ignore_index;
  a.stream = rlkernel::current_cuda_stream(tile.device().index());
}

// Folds one chunk's tile into the rows' running state; the last chunk writes logp, entropy (when it has elements)
// and stats, and reports bad ids (error_record: the device record's address, 0 = nowhere).
void fold(const Tensor& tile, const Tensor& ids, Tensor& state, Tensor& logp, Tensor& entropy, Tensor& stats,
          int64_t col0, int64_t vocab, double temperature, int64_t ignore_index, bool first, bool last, int64_t row0,
          int64_t error_record, int64_t error_seq) {
  check_tile(tile);
  const int64_t n = tile.size(0);
  check_ids(ids, n, tile);
  check_f32(state, 4 * n, tile, "state");
  check_f32(logp, n, tile, "logp");
  check_f32(stats, 2 * n, tile, "stats");
  const bool with_entropy = entropy.numel() > 0;
  if (with_entropy) check_f32(entropy, n, tile, "entropy");
  TORCH_CHECK(temperature > 0.0, kOp, ": temperature must be > 0");
  TORCH_CHECK(col0 >= 0 && col0 + tile.size(1) <= vocab, kOp, ": chunk outside the vocabulary");
  c10::DeviceGuard guard(tile.device());
  rlkernel::LinearFoldArgs a{};
  fill_tile(a, tile, ids, n, col0, vocab, temperature, ignore_index);
  a.state = state.data_ptr<float>();
  a.first = first;
  a.last = last;
  a.logp = logp.data_ptr<float>();
  a.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  a.stats = stats.data_ptr<float>();
  a.row0 = row0;
  a.errors = rlkernel::error_sink(error_record, error_seq, rlkernel::kErrOpLogpBadId);
  const char* err = rlkernel::linear_logp_fold(a);
  TORCH_CHECK(err == nullptr, kOp, " fold: ", err);
}

// Turns the recomputed tile (rows 0..n-1 real, the rest padding) into the gradient of its logits: in place, or
// with `out` (a float32 tile, a bf16 / fp16 out of its shape) rounded once into out, the tile only read.
void grad_tile(Tensor& tile, const Tensor& ids, const Tensor& stats, const std::optional<Tensor>& grad_logp,
               const std::optional<Tensor>& grad_entropy, const Tensor& entropy, int64_t col0, int64_t vocab,
               double temperature, int64_t ignore_index, const std::optional<Tensor>& out) {
  check_tile(tile);
  if (out.has_value()) {
    check_tile(*out);
    TORCH_CHECK(tile.scalar_type() == at::kFloat &&
                (out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf) &&
                out->sizes() == tile.sizes() && out->device() == tile.device(), kOp,
                ": grad_tile's out must be bf16 / fp16 of a float32 tile's shape and device");
  }
  const int64_t n = ids.numel();
  TORCH_CHECK(n <= tile.size(0), kOp, ": more ids than tile rows");
  check_ids(ids, n, tile);
  TORCH_CHECK(temperature > 0.0, kOp, ": temperature must be > 0");
  c10::DeviceGuard guard(tile.device());
  rlkernel::LinearGradArgs a{};
  fill_tile(a, tile, ids, n, col0, vocab, temperature, ignore_index);
  a.tile_rows = tile.size(0);
  fill_row_grads(a, grad_logp, grad_entropy, entropy, stats, n, tile);
  if (out.has_value()) {
    a.out = out->data_ptr();
    a.out_stride = out->stride(0);
    a.out_dtype = rlkernel::elem_type_of(*out, kOp);
  }
  const char* err = rlkernel::linear_logp_grad(a);
  TORCH_CHECK(err == nullptr, kOp, " grad: ", err);
}

// out (float32 [cols]) (+)= column sums of the tile's first n_rows rows; partial: float32 scratch.
void colsum(const Tensor& tile, int64_t n_rows, Tensor& partial, Tensor& out, bool accumulate) {
  check_tile(tile);
  TORCH_CHECK(n_rows >= 0 && n_rows <= tile.size(0), kOp, ": bad row count");
  const int64_t cols = tile.size(1);
  check_f32(out, cols, tile, "out");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
              partial.numel() >= rlkernel::linear_logp_colsum_blocks(n_rows) * cols, kOp, ": partial too small");
  c10::DeviceGuard guard(tile.device());
  const char* err = rlkernel::linear_logp_colsum(
      tile.data_ptr(), tile.stride(0), n_rows, cols, rlkernel::elem_type_of(tile, kOp), partial.data_ptr<float>(),
      out.data_ptr<float>(), accumulate, rlkernel::current_cuda_stream(tile.device().index()));
  TORCH_CHECK(err == nullptr, kOp, " colsum: ", err);
}

// dst = (accumulate: dst +) the first dst.numel() elements of src (float32 or dst's dtype), both contiguous.
void cast(const Tensor& src, Tensor& dst, bool accumulate) {
  TORCH_CHECK(src.is_cuda() && dst.device() == src.device() && src.is_contiguous() && dst.is_contiguous() &&
              src.numel() >= dst.numel(), kOp, ": cast needs contiguous CUDA tensors, src at least as large");
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == dst.scalar_type(), kOp,
              ": cast from float32 or the same dtype only");
  c10::DeviceGuard guard(dst.device());
  const char* err = rlkernel::linear_logp_cast(src.data_ptr(), src.scalar_type() == at::kFloat, dst.data_ptr(),
                                               rlkernel::elem_type_of(dst, kOp), dst.numel(), accumulate,
                                               rlkernel::current_cuda_stream(dst.device().index()));
  TORCH_CHECK(err == nullptr, kOp, " cast: ", err);
}

// tile [rows, cols] contiguous: every row = bias [cols] (contiguous, the tile's dtype).
void bias_rows(const Tensor& bias, Tensor& tile) {
  TORCH_CHECK(tile.is_cuda() && bias.device() == tile.device() && tile.dim() == 2 && tile.is_contiguous() &&
              bias.dim() == 1 && bias.is_contiguous() && bias.size(0) == tile.size(1) &&
              bias.scalar_type() == tile.scalar_type(), kOp, ": bias_rows needs bias [cols] and a contiguous tile");
  c10::DeviceGuard guard(tile.device());
  const char* err = rlkernel::linear_logp_bias_rows(bias.data_ptr(), tile.data_ptr(), tile.size(0), tile.size(1),
                                                    rlkernel::elem_type_of(tile, kOp),
                                                    rlkernel::current_cuda_stream(tile.device().index()));
  TORCH_CHECK(err == nullptr, kOp, " bias_rows: ", err);
}

// dst [R, H] contiguous = src [rows <= R, H] (any row stride, contiguous last dim), then zero rows.
void pack(const Tensor& src, Tensor& dst) {
  TORCH_CHECK(src.is_cuda() && dst.device() == src.device() && src.dim() == 2 && dst.dim() == 2 &&
              dst.is_contiguous() && src.size(1) == dst.size(1) && src.size(0) <= dst.size(0) &&
              (src.size(1) <= 1 || src.stride(1) == 1) && src.scalar_type() == dst.scalar_type(),
              kOp, ": pack needs src [rows, H] (contiguous last dim) and a contiguous dst [R >= rows, H]");
  c10::DeviceGuard guard(dst.device());
  const char* err = rlkernel::linear_logp_pack(src.data_ptr(), src.size(0) > 1 ? src.stride(0) : src.size(1),
                                               src.size(0), src.size(1), rlkernel::elem_type_of(dst, kOp),
                                               dst.data_ptr(), dst.size(0),
                                               rlkernel::current_cuda_stream(dst.device().index()));
  TORCH_CHECK(err == nullptr, kOp, " pack: ", err);
}

// The operands of an epilogue GEMM (issue 37): hidden [N, H] (contiguous last dim) @ weight [V, H]^T (+ bias [V]).
void check_gemm_operands(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias,
                         int64_t config) {
  TORCH_CHECK(config >= 0 && config <= 2, kOp, ": epilogue: config must be 0, 1 or 2");
  TORCH_CHECK(hidden.is_cuda() && hidden.dim() == 2 && (hidden.size(1) <= 1 || hidden.stride(1) == 1), kOp,
              ": epilogue: hidden must be CUDA [N, H] with a contiguous last dim");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == hidden.size(1) &&
              weight.scalar_type() == hidden.scalar_type() && weight.device() == hidden.device(), kOp,
              ": epilogue: weight must be contiguous [V, H], of hidden's dtype and device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == weight.size(0) &&
                bias->scalar_type() == hidden.scalar_type() && bias->device() == hidden.device(), kOp,
                ": epilogue: bias must be contiguous [V] of hidden's dtype");
  }
}

// The fields LinearEpilogueArgs and LinearGradEpilogueArgs share (same names, same meaning): the GEMM's operands
// (checked by check_gemm_operands), the rows' ids, T, ignore_index, the config, the device and its stream.
template <class Args>
void fill_gemm(Args& a, const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias,
               const Tensor& ids, double temperature, int64_t ignore_index, int64_t config) {
  a.hidden = hidden.data_ptr();
  a.hidden_stride = hidden.size(0) > 1 ? hidden.stride(0) : hidden.size(1);
  a.weight = weight.data_ptr();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.ids = ids.data_ptr<int64_t>();
  a.n_rows = ids.numel();
  a.hidden_size = hidden.size(1);
  a.dtype = rlkernel::elem_type_of(hidden, kOp);
  a.temperature = temperature;
  a.ignore_index = ignore_index;
  a.config = static_cast<int>(config);
  a.device = hidden.device().index();
  a.stream = rlkernel::current_cuda_stream(hidden.device().index());
}

// The epilogue GEMM (issue 37): logp / entropy / stats of hidden @ weight^T (+ bias) straight from the GEMM's
// accumulator; partial: float32 scratch of at least n * linear_logp_epilogue_tiles(V) * 4 elements.
void epilogue(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& ids,
              Tensor& partial, Tensor& logp, Tensor& entropy, Tensor& stats, double temperature, int64_t ignore_index,
              int64_t row0, int64_t error_record, int64_t error_seq, int64_t config) {
  check_gemm_operands(hidden, weight, bias, config);
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  check_ids(ids, n, hidden);
  check_f32(logp, n, hidden, "logp");
  check_f32(stats, 2 * n, hidden, "stats");
  const bool with_entropy = entropy.numel() > 0;
  if (with_entropy) check_f32(entropy, n, hidden, "entropy");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() && partial.device() == hidden.device() &&
              partial.numel() >= n * rlkernel::linear_logp_epilogue_tiles(vocab, static_cast<int>(config)) * 4, kOp,
              ": epilogue: partial too small");
  TORCH_CHECK(temperature > 0.0, kOp, ": temperature must be > 0");
  c10::DeviceGuard guard(hidden.device());
  rlkernel::LinearEpilogueArgs a{};
  fill_gemm(a, hidden, weight, bias, ids, temperature, ignore_index, config);
  a.vocab = vocab;
  a.partial = partial.data_ptr<float>();
  a.logp = logp.data_ptr<float>();
  a.entropy = with_entropy ? entropy.data_ptr<float>() : nullptr;
  a.stats = stats.data_ptr<float>();
  a.row0 = row0;
  a.errors = rlkernel::error_sink(error_record, error_seq, rlkernel::kErrOpLogpBadId);
  const char* err = rlkernel::linear_logp_epilogue(a);
  TORCH_CHECK(err == nullptr, kOp, " epilogue: ", err);
}

// The epilogue GEMM's backward of one vocabulary chunk: out [rows, cols] (hidden's dtype) = the gradient of the
// rows' logp / entropy with respect to the logits hidden @ weight^T (+ bias), weight and bias being the chunk's
// [cols, H] and [cols]; the first ids.numel() rows have ids, the rest are padding (gradient 0).
void grad_epilogue(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& ids,
                   const Tensor& stats, const std::optional<Tensor>& grad_logp,
                   const std::optional<Tensor>& grad_entropy, const Tensor& entropy, int64_t col0, int64_t vocab,
                   double temperature, int64_t ignore_index, Tensor& out, int64_t config) {
  check_gemm_operands(hidden, weight, bias, config);
  const int64_t rows = hidden.size(0), cols = weight.size(0), n = ids.numel();
  TORCH_CHECK(n <= rows, kOp, ": grad_epilogue: more ids than hidden rows");
  check_ids(ids, n, hidden);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == cols && (cols <= 1 || out.stride(1) == 1) &&
              out.scalar_type() == hidden.scalar_type() && out.device() == hidden.device(), kOp,
              ": grad_epilogue: out must be [rows, cols] of hidden's dtype, last dim contiguous");
  TORCH_CHECK(col0 >= 0 && col0 + cols <= vocab, kOp, ": chunk outside the vocabulary");
  TORCH_CHECK(temperature > 0.0, kOp, ": temperature must be > 0");
  c10::DeviceGuard guard(hidden.device());
  rlkernel::LinearGradEpilogueArgs a{};
  fill_gemm(a, hidden, weight, bias, ids, temperature, ignore_index, config);
  fill_row_grads(a, grad_logp, grad_entropy, entropy, stats, n, hidden);
  a.tile_rows = rows;
  a.cols = cols;
  a.col0 = col0;
  a.vocab = vocab;
  a.out = out.data_ptr();
  a.out_stride = rows > 1 ? out.stride(0) : cols;
  const char* err = rlkernel::linear_logp_grad_epilogue(a);
  TORCH_CHECK(err == nullptr, kOp, " grad_epilogue: ", err);
}

int64_t epilogue_tiles(int64_t vocab, int64_t config) {
  TORCH_CHECK(config >= 0 && config <= 2, kOp, ": epilogue: config must be 0, 1 or 2");
  return rlkernel::linear_logp_epilogue_tiles(vocab, static_cast<int>(config));
}

bool epilogue_built() { return rlkernel::linear_logp_epilogue_built(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("linear_logp_fold(Tensor tile, Tensor token_ids, Tensor(a!) state, Tensor(b!) logp, Tensor(c!) entropy, "
        "Tensor(d!) stats, int col0, int vocab, float temperature, int ignore_index, bool first, bool last, "
        "int row0=0, int error_record=0, int error_seq=0) -> ()");
  m.def("linear_logp_grad_tile(Tensor(a!) tile, Tensor token_ids, Tensor stats, Tensor? grad_logp, "
        "Tensor? grad_entropy, Tensor entropy, int col0, int vocab, float temperature, int ignore_index, "
        "Tensor(b!)? out=None) -> ()");
  m.def("linear_logp_colsum(Tensor tile, int n_rows, Tensor(a!) partial, Tensor(b!) out, bool accumulate) -> ()");
  m.def("linear_logp_cast(Tensor src, Tensor(a!) dst, bool accumulate=False) -> ()");
  m.def("linear_logp_pack(Tensor src, Tensor(a!) dst) -> ()");
  m.def("linear_logp_bias_rows(Tensor bias, Tensor(a!) tile) -> ()");
  m.def("linear_logp_epilogue(Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, Tensor(a!) partial, "
        "Tensor(b!) logp, Tensor(c!) entropy, Tensor(d!) stats, float temperature, int ignore_index, int row0=0, "
        "int error_record=0, int error_seq=0, int config=0) -> ()");
  m.def("linear_logp_grad_epilogue(Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, Tensor stats, "
        "Tensor? grad_logp, Tensor? grad_entropy, Tensor entropy, int col0, int vocab, float temperature, "
        "int ignore_index, Tensor(a!) out, int config=0) -> ()");
  m.def("linear_logp_epilogue_tiles(int vocab, int config=0) -> int", &epilogue_tiles);
  m.def("linear_logp_epilogue_built() -> bool", &epilogue_built);
}

TORCH_LIBRARY_IMPL(rlkernel, CUDA, m) {
  m.impl("linear_logp_fold", &fold);
  m.impl("linear_logp_grad_tile", &grad_tile);
  m.impl("linear_logp_colsum", &colsum);
  m.impl("linear_logp_cast", &cast);
  m.impl("linear_logp_pack", &pack);
  m.impl("linear_logp_bias_rows", &bias_rows);
  m.impl("linear_logp_epilogue", &epilogue);
  m.impl("linear_logp_grad_epilogue", &grad_epilogue);
}
