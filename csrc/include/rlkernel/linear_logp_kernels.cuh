// Kernels of the fused LM-head log-prob op (rlkernel.linear_logp), framework-free: raw pointers, sizes, strides.
//
// The op never holds the N x V logits. A cuBLAS GEMM writes one tile, [rows x cols] logits of a token block and a
// vocabulary chunk (bias included), into a reused workspace; these kernels work on that tile:
// - fold: each row's tile is reduced to its online-softmax state (row_reduce.cuh: base-2 units, y = x * log2(e)/T)
//   and merged into the row's running state (m, s, t, x_target) from the earlier chunks, in chunk order; the last
//   chunk turns the state into logp, entropy and the stats (r, log2 s) the backward needs. A row's order of
//   operations depends only on the chunk width and the element type, never on the number of rows.
// - grad: the recomputed tile becomes, in place, the gradient of the logits, (1/T)[g_l (onehot - p) - g_H p (log p
//   + H)], with p from the saved stats; rows past n_rows (padding) and ignored rows become 0, bad-id rows NaN. A
//   float32 tile's gradient can go instead, rounded once, to a 16-bit output (the tile then only read).
// - colsum: column sums of the gradient tile (the bias gradient), two passes in a fixed order (deterministic).
// - cast / pack: float32 accumulator rows to the output dtype; hidden rows into a zero-padded block.
#pragma once

#include "rlkernel/error_record.cuh"
#include "rlkernel/row_grad.cuh"
#include "rlkernel/row_reduce.cuh"

namespace rlkernel {

struct LinearFoldParams {
  const void* tile;        // [n_rows, cols] logits of this chunk, last dim contiguous
  long long row_stride;    // elements
  const long long* ids;    // [n_rows]
  long long n_rows;
  int cols;
  long long col0;          // the chunk's first vocabulary column
  long long vocab;
  float c;                 // log2(e) / T
  long long ignore_index;
  float4* state;           // [n_rows]: (m, s, t, x_target) after the chunks so far
  bool first, last;
  float* logp;             // [n_rows] (last chunk)
  float* entropy;          // [n_rows] or unused without ENTROPY
  float2* stats;           // [n_rows] (r, log2 s)
  long long row0;          // the block's first row in the whole call (error positions)
  ErrorSink errors;
};

template <typename T, int TEAM, bool ENTROPY>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_fold_kernel(const LinearFoldParams p) {
  __shared__ TeamSmem smem;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  const bool in_range = row < p.n_rows;
  const long long id = in_range ? p.ids[row] : p.ignore_index;
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab);
  const bool active = in_range && !ignored && !bad;
  const bool leader = threadIdx.x % TEAM == 0;
  const T* row_ptr = static_cast<const T*>(p.tile) + (in_range ? row * p.row_stride : 0);
  const long long local = id - p.col0;
  const bool has_target = active && local >= 0 && local < p.cols;
  const float x_t = (has_target && leader) ? ElemTraits<T>::to_float(row_ptr[local]) : 0.0f;
  const RowState chunk = team_row_state<T, TEAM, ENTROPY>(row_ptr, p.cols, p.c, active, smem);
  if (!(in_range && leader)) return;
  if (active) {
    RowState st = chunk;
    float target = x_t;
    if (!p.first) {  // merged in chunk order: the earlier chunks' state first
      const float4 prev = p.state[row];
      st = merge_state<ENTROPY>(RowState{prev.x, prev.y, prev.z}, chunk);
      target = has_target ? x_t : prev.w;
    }
    if (!p.last) {
      p.state[row] = make_float4(st.m, st.s, st.t, target);
      return;
    }
    const RowResult r = finish_row<ENTROPY>(st);
    p.logp[row] = target_logp(target, p.c, r);
    if (ENTROPY) p.entropy[row] = r.entropy;
    p.stats[row] = make_float2(r.ref, r.log2s);
  } else if (p.last) {
    const float fill = ignored ? 0.0f : NAN;
    p.logp[row] = fill;
    if (ENTROPY) p.entropy[row] = fill;
    p.stats[row] = make_float2(fill, fill);
    if (bad) report_error(p.errors, p.row0 + row, id);
  }
}

template <typename D> __device__ __forceinline__ D from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <typename S> __device__ __forceinline__ float to_float_any(S v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return ElemTraits<S>::to_float(v);
  }
}

struct LinearGradParams {
  void* tile;              // [tile_rows, cols], overwritten by the gradient
  long long row_stride;
  const long long* ids;    // [n_rows]
  long long n_rows;        // rows with an id; rows n_rows .. tile_rows-1 are padding (gradient 0)
  long long tile_rows;
  int cols;
  long long col0;
  long long vocab;
  float c;                 // log2(e) / T
  float inv_t;             // 1 / T
  long long ignore_index;
  RowGradInputs in;        // [n_rows] rows: g_l, g_H, the forward's entropy and stats (row_grad.cuh)
};

// The grad kernel with a 16-bit output of a float32 tile (float32 logits, issue 36): the tile is only read and the
// gradient, rounded once, goes to `out`, the dW / dH GEMMs' operand (no cast pass over the float32 tile). A type
// of its own, so the in-place kernels keep LinearGradParams as it was (the option kernels' params embed it).
struct LinearGradOutParams : LinearGradParams {
  void* out;               // [tile_rows, cols] of the output type, last dim contiguous
  long long out_stride;
};

__device__ __forceinline__ unsigned short bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Stores f[0..3] (one float32 vector's gradient) at element e0 of a 16-bit row, skipping elements at or past V, each
// rounded by from_float: the cast kernel's conversion, so the bits are those of the in-place float32 gradient cast
// afterwards. One 8-byte store when the row start is 8-byte aligned and the vector is whole.
template <typename O>
__device__ __forceinline__ void store_rounded4(O* __restrict__ row, int e0, int V, bool aligned8, const float* f) {
  unsigned short b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = bits16(from_float<O>(f[i]));
  if (aligned8 && e0 + 4 <= V) {
    const uint2 packed = make_uint2(b[0] | (unsigned{b[1]} << 16), b[2] | (unsigned{b[3]} << 16));
    __stcs(reinterpret_cast<uint2*>(row + e0), packed);
    return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (e0 + i < V) reinterpret_cast<unsigned short*>(row)[e0 + i] = b[i];
}

// O == T: in place. O 16-bit (T float32 only): the gradient rounded into p.out, the tile only read. (P is a template
// parameter of its own, not an alias of T and O in the signature: nvcc's host stubs cannot name such an alias.)
template <typename T, int TEAM, bool HAS_GH, typename O = T,
          typename P = std::conditional_t<std::is_same_v<T, O>, LinearGradParams, LinearGradOutParams>>
__global__ void __launch_bounds__(kCtaThreads, 2) rlkernel_linear_logp_grad_kernel(const P p) {
  constexpr bool kInPlace = std::is_same_v<T, O>;
  static_assert(kInPlace || (std::is_same_v<T, float> && sizeof(O) == 2), "a 16-bit output of a float32 tile only");
  constexpr int VEC = ElemTraits<T>::kVec;
  constexpr int CHUNK = TEAM * kUnroll * VEC;
  constexpr int kTeams = kCtaThreads / TEAM;
  const long long row = static_cast<long long>(blockIdx.x) * kTeams + threadIdx.x / TEAM;
  if (row >= p.tile_rows) return;  // no barrier here: a team without a row just leaves
  const int tid = threadIdx.x % TEAM;
  const bool pad = row >= p.n_rows;
  const long long id = pad ? p.ignore_index : p.ids[row];
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab);
  T* g_row = static_cast<T*>(p.tile) + row * p.row_stride;
  const bool aligned = (reinterpret_cast<uintptr_t>(g_row) & 15u) == 0;
  const int V = p.cols;
  O* o_row = nullptr;
  bool o_aligned = false;
  if constexpr (!kInPlace) {
    o_row = static_cast<O*>(p.out) + row * p.out_stride;
    o_aligned = (reinterpret_cast<uintptr_t>(o_row) & 7u) == 0;
  }
  if (ignored || bad) {  // ignored and padding rows: 0, so the GEMMs get nothing from them; a bad id: NaN
    if constexpr (kInPlace) {
      fill_grad_row<T, TEAM>(g_row, V, aligned, tid, ignored ? 0.0f : NAN);
    } else {  // by store_rounded4 (not fill_grad_row<O>), so a bad row's NaN has the cast kernel's bits too
      float f[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) f[i] = ignored ? 0.0f : NAN;
      for (int base = 0; base < V; base += CHUNK)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int e0 = base + (u * TEAM + tid) * VEC;
          if (e0 < V) store_rounded4<O>(o_row, e0, V, o_aligned, f);
        }
    }
    return;
  }
  const RowGradCoeffs k = row_grad_coeffs<HAS_GH>(p.in, row, p.inv_t);
  const long long local = id - p.col0;
  const int target = (local >= 0 && local < V) ? static_cast<int>(local) : -1;  // -1: in another chunk
  // in place: the loop of rlkernel_logp_bwd_kernel, kept written out (row_grad.cuh says why)
  for (int base = 0; base < V; base += CHUNK) {
    RawVec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      v[u] = e0 < V ? load_vec<T>(g_row, e0, V, aligned) : neg_inf_vec<T>();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e0 = base + (u * TEAM + tid) * VEC;
      float f[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float lp = fmaf(raw_elem<T>(v[u], i), p.c, -k.ref) - k.log2s;  // log2 p
        const float pr = fast_exp2(lp);
        f[i] = HAS_GH ? pr * fmaf(k.B, fmaxf(lp, kExpFloor), k.A) : pr * k.A;
      }
      if (static_cast<unsigned>(target - e0) < static_cast<unsigned>(VEC)) {  // target -1: never
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (e0 + i == target) f[i] += k.G;
      }
      if constexpr (kInPlace) {
        pack_vec<T>(v[u], f);
        if (e0 < V) store_vec<T>(g_row, e0, V, aligned, v[u]);
      } else if (e0 < V) {
        store_rounded4<O>(o_row, e0, V, o_aligned, f);
      }
    }
  }
}

// Column sums, pass 1: partial[b, col] = sum of rows b*kColsumRows .. (b+1)*kColsumRows-1 of the tile, in row order.
constexpr int kColsumRows = 128;
constexpr int kColsumThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kColsumThreads) rlkernel_linear_logp_colsum_kernel(
    const T* __restrict__ tile, long long row_stride, long long n_rows, int cols, float* __restrict__ partial) {
  const int col = blockIdx.x * kColsumThreads + threadIdx.x;
  if (col >= cols) return;
  const long long r0 = static_cast<long long>(blockIdx.y) * kColsumRows;
  const long long r1 = r0 + kColsumRows < n_rows ? r0 + kColsumRows : n_rows;
  float s = 0.0f;
  for (long long r = r0; r < r1; ++r) s += ElemTraits<T>::to_float(tile[r * row_stride + col]);
  partial[static_cast<long long>(blockIdx.y) * cols + col] = s;
}

// Pass 2 (rlkernel_linear_logp_colsum_finish_kernel) is defined in csrc/linear_logp.cu, its one launcher: a
// non-template kernel defined in a header would be defined again by every .cu that includes it (a link error).

// dst[i] = src[i] for i < n (S -> D, round to nearest even); both contiguous. accumulate: dst[i] += src[i] (in
// float32, then rounded to D).
template <typename S, typename D>
__global__ void rlkernel_linear_logp_cast_kernel(const S* __restrict__ src, D* __restrict__ dst, long long n,
                                                 bool accumulate) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (accumulate) {
      dst[i] = from_float<D>(to_float_any<D>(dst[i]) + to_float_any<S>(src[i]));
    } else if constexpr (std::is_same_v<S, D>) {
      dst[i] = src[i];
    } else {
      dst[i] = from_float<D>(to_float_any<S>(src[i]));
    }
  }
}

// dst [rows, cols] contiguous: every row = bias [cols] (the C operand of a beta = 1 GEMM: logits with the bias).
template <typename T>
__global__ void rlkernel_linear_logp_bias_rows_kernel(const T* __restrict__ bias, T* __restrict__ dst, long long rows,
                                                      long long cols) {
  const long long n = rows * cols;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = bias[i % cols];
  }
}

// dst [dst_rows, cols] contiguous = src rows 0 .. rows-1 (row stride src_stride), zeros below.
template <typename T>
__global__ void rlkernel_linear_logp_pack_kernel(const T* __restrict__ src, long long src_stride, long long rows,
                                                 long long cols, T* __restrict__ dst, long long dst_rows) {
  const long long n = dst_rows * cols;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const long long r = i / cols, col = i - r * cols;
    dst[i] = r < rows ? src[r * src_stride + col] : from_float<T>(0.0f);
  }
}

}  // namespace rlkernel
