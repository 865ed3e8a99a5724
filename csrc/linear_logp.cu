// Launchers of the fused LM-head log-prob kernels (csrc/include/rlkernel/linear_logp_kernels.cuh). No torch include
// (the CI compile gate builds this with nvcc alone). No NVTX range here: the op's range (op.linear_logp.forward /
// .backward) is opened by rlkernel/ops/fused/linear_logp.py around the GEMMs and these launches together.
#include <cuda_runtime.h>

#include <type_traits>

#include "rlkernel/launch.cuh"
#include "rlkernel/linear_logp_api.h"
#include "rlkernel/linear_logp_kernels.cuh"

namespace rlkernel {

// Pass 2: out[col] (+)= the partials in block order.
__global__ void __launch_bounds__(kColsumThreads) rlkernel_linear_logp_colsum_finish_kernel(
    const float* __restrict__ partial, int blocks, int cols, float* __restrict__ out, bool accumulate) {
  const int col = blockIdx.x * kColsumThreads + threadIdx.x;
  if (col >= cols) return;
  float s = accumulate ? out[col] : 0.0f;
  for (int b = 0; b < blocks; ++b) s += partial[static_cast<long long>(b) * cols + col];
  out[col] = s;
}

namespace {

using launch::inverse;
using launch::last_error;
using launch::launch_row_kernel;
using launch::log2e_over;
using launch::row_grad_inputs;
using launch::with_type;

unsigned elementwise_grid(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

const char* linear_logp_fold(const LinearFoldArgs& a) {
  if (a.n_rows == 0) return nullptr;
  LinearFoldParams p;
  p.tile = a.tile;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.cols = static_cast<int>(a.cols);
  p.col0 = a.col0;
  p.vocab = a.vocab;
  p.c = log2e_over(a.temperature);
  p.ignore_index = a.ignore_index;
  p.state = reinterpret_cast<float4*>(a.state);
  p.first = a.first;
  p.last = a.last;
  p.logp = a.logp;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<float2*>(a.stats);
  p.row0 = a.row0;
  p.errors = a.errors;
  return launch_row_kernel(a.dtype, a.cols, a.n_rows, a.entropy != nullptr, a.stream, p,
                           [](auto tag, auto team, auto entropy) {
                             return rlkernel_linear_logp_fold_kernel<decltype(tag), decltype(team)::value,
                                                                     decltype(entropy)::value>;
                           });
}

namespace {

// The grad kernel's params from the args (the fields both kinds share).
void fill_grad_params(LinearGradParams& p, const LinearGradArgs& a) {
  p.tile = a.tile;
  p.row_stride = a.row_stride;
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.tile_rows = a.tile_rows;
  p.cols = static_cast<int>(a.cols);
  p.col0 = a.col0;
  p.vocab = a.vocab;
  p.c = log2e_over(a.temperature);
  p.inv_t = inverse(a.temperature);
  p.ignore_index = a.ignore_index;
  p.in = row_grad_inputs(a);
}

// A float32 tile's gradient rounded into a 16-bit a.out: the float32 instantiations with O = a.out_dtype.
const char* linear_logp_grad_out(const LinearGradArgs& a) {
  if (a.dtype != ElemType::kFloat32 || a.out_dtype == ElemType::kFloat32) {
    return "rlkernel linear_logp grad: a separate output needs a float32 tile and a 16-bit output";
  }
  LinearGradOutParams p;
  fill_grad_params(p, a);
  p.out = a.out;
  p.out_stride = a.out_stride;
  const char* err = nullptr;
  const char* bad_type = with_type(a.out_dtype, [&](auto out_tag) {
    using O = decltype(out_tag);
    // every tile row, padding included, gets a gradient (0 for padding)
    err = launch_row_kernel(a.dtype, a.cols, a.tile_rows, a.grad_entropy != nullptr, a.stream, p,
                             [](auto tag, auto team, auto has_gh) {
                               // T is float32 here (checked above): the 16-bit tags only name in-place kernels,
                               // never launched from here (p would convert to their LinearGradParams)
                               using T = decltype(tag);
                               return rlkernel_linear_logp_grad_kernel<T, decltype(team)::value,
                                                                       decltype(has_gh)::value,
                                                                       std::conditional_t<sizeof(T) == 4, O, T>>;
                             });
  });
  return bad_type ? bad_type : err;
}

}  // namespace

const char* linear_logp_grad(const LinearGradArgs& a) {
  if (a.tile_rows == 0 || a.cols == 0) return nullptr;
  if (a.out != nullptr) return linear_logp_grad_out(a);
  LinearGradParams p;
  fill_grad_params(p, a);
  // every tile row, padding included, gets a gradient (0 for padding)
  return launch_row_kernel(a.dtype, a.cols, a.tile_rows, a.grad_entropy != nullptr, a.stream, p,
                           [](auto tag, auto team, auto has_gh) {
                             return rlkernel_linear_logp_grad_kernel<decltype(tag), decltype(team)::value,
                                                                     decltype(has_gh)::value>;
                           });
}

int64_t linear_logp_colsum_blocks(int64_t n_rows) { return (n_rows + kColsumRows - 1) / kColsumRows; }

const char* linear_logp_colsum(const void* tile, int64_t row_stride, int64_t n_rows, int64_t cols, ElemType dtype,
                               float* partial, float* out, bool accumulate, void* stream_ptr) {
  if (cols == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t blocks = linear_logp_colsum_blocks(n_rows);
  const unsigned col_blocks = static_cast<unsigned>((cols + kColsumThreads - 1) / kColsumThreads);
  const char* err = nullptr;
  if (blocks > 0) {
    err = with_type(dtype, [&](auto tag) {
      using T = decltype(tag);
      const dim3 grid(col_blocks, static_cast<unsigned>(blocks));
      rlkernel_linear_logp_colsum_kernel<T><<<grid, kColsumThreads, 0, stream>>>(
          static_cast<const T*>(tile), row_stride, n_rows, static_cast<int>(cols), partial);
    });
  }
  if (err) return err;
  rlkernel_linear_logp_colsum_finish_kernel<<<col_blocks, kColsumThreads, 0, stream>>>(
      partial, static_cast<int>(blocks), static_cast<int>(cols), out, accumulate);
  return last_error();
}

const char* linear_logp_cast(const void* src, bool src_is_float, void* dst, ElemType dst_dtype, int64_t n,
                             bool accumulate, void* stream_ptr) {
  if (n == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const char* err = with_type(dst_dtype, [&](auto tag) {
    using D = decltype(tag);
    if (src_is_float) {
      rlkernel_linear_logp_cast_kernel<float, D><<<elementwise_grid(n), 256, 0, stream>>>(
          static_cast<const float*>(src), static_cast<D*>(dst), n, accumulate);
    } else {
      rlkernel_linear_logp_cast_kernel<D, D><<<elementwise_grid(n), 256, 0, stream>>>(
          static_cast<const D*>(src), static_cast<D*>(dst), n, accumulate);
    }
  });
  return err ? err : last_error();
}

const char* linear_logp_bias_rows(const void* bias, void* dst, int64_t rows, int64_t cols, ElemType dtype,
                                  void* stream_ptr) {
  if (rows * cols == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const char* err = with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    rlkernel_linear_logp_bias_rows_kernel<T><<<elementwise_grid(rows * cols), 256, 0, stream>>>(
        static_cast<const T*>(bias), static_cast<T*>(dst), rows, cols);
  });
  return err ? err : last_error();
}

const char* linear_logp_pack(const void* src, int64_t src_stride, int64_t rows, int64_t cols, ElemType dtype,
                             void* dst, int64_t dst_rows, void* stream_ptr) {
  if (dst_rows * cols == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const char* err = with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    rlkernel_linear_logp_pack_kernel<T><<<elementwise_grid(dst_rows * cols), 256, 0, stream>>>(
        static_cast<const T*>(src), src_stride, rows, cols, static_cast<T*>(dst), dst_rows);
  });
  return err ? err : last_error();
}

}  // namespace rlkernel
