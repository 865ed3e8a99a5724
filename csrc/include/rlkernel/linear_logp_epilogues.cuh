// The epilogues of the epilogue GEMM (csrc/linear_logp_epilogue.cu, issue 37): sm70-style CUTLASS epilogue
// collectives that the sm90 warp-specialized kernels run on their float32 accumulator fragment through
// Sm90TmaWarpSpecializedAdapter, so no logits tile is ever written:
// - SoftmaxPartialEpilogue (the forward): per (row, column tile) online-softmax partials, merged per row afterwards;
// - SoftmaxGradEpilogue (the backward of one vocabulary chunk in linear_logp, or of a token chunk over the whole
//   vocabulary in linear_logp_loss): the logits' gradient, rounded once to 16 bits, the dW / dH GEMMs' operand.
// Needs the CUTLASS / CuTe headers (the nvidia-cutlass wheel); the .cu includes this only where it has them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <climits>
#include <cstdint>

#include "rlkernel/linear_logp_kernels.cuh"  // from_float, bits16
#include "rlkernel/row_grad.cuh"
#include "rlkernel/row_reduce.cuh"

namespace rlkernel {

// Partial stats of one (row, column tile): x = m, y = s, z = t (rlkernel::RowState over y = logit * c), w = the
// target's logit when the target column lies in this tile, else 0. Layout [rows, tiles] (a row's partials
// contiguous for the merge).
struct EpiloguePartialParams {
  const void* bias;        // [vocab] in the inputs' dtype, or nullptr
  const long long* ids;    // [rows]
  float4* partial;         // [rows, tiles]
  int tiles;               // ceil(vocab / tile N)
  float c;                 // log2(e) / T
  bool entropy;            // compute the entropy term t
};

// The gradient epilogue's inputs: the backward of one vocabulary chunk (the GEMM's N is the chunk's columns; the
// whole vocabulary, col0 = 0, in linear_logp_loss).
struct EpilogueGradParams {
  const void* bias;        // [N] (the chunk's columns) in the inputs' dtype, or nullptr
  const long long* ids;    // [n_rows] vocabulary ids
  long long n_rows;        // rows with an id; the GEMM's rows n_rows .. M-1 are padding (gradient 0)
  long long col0;          // the chunk's first vocabulary column
  long long vocab;         // the whole vocabulary (a bad id: outside [0, vocab))
  long long ignore_index;
  float c;                 // log2(e) / T
  float inv_t;             // 1 / T
  RowGradInputs in;        // g_l, g_H, the forward's entropy and stats (row_grad.cuh)
  void* out;               // [M, N] 16-bit gradient (the inputs' dtype), last dim contiguous
  long long out_stride;
  bool pairs_aligned;      // out 4-byte aligned and out_stride even: every row starts 4-byte aligned
};

namespace epilogue_gemm {

template <typename T> struct Cutlass;
template <> struct Cutlass<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct Cutlass<__half> { using type = cutlass::half_t; };

// What Sm90TmaWarpSpecializedAdapter asks of an sm70-style epilogue collective (operator() on the accumulator
// fragment) besides operator() itself: no C operand, no shared memory, no workspace; the arguments are the params.
template <class P>
struct AdapterEpilogue {
  using ElementC = float;  // unused (no C operand): the kernel only names these types
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = P;
  using Params = P;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit AdapterEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

 protected:
  Params params_;
};

// (row, col) of each element of this thread's accumulator fragment: CuTe's partition of an identity tensor over
// the tile, so nothing of the GMMA layout is assumed.
template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class TiledMma>
CUTLASS_DEVICE auto thread_coords(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                  BlockCoordMNKL blk_coord_mnkl, TiledMma tiled_mma, int thread_idx) {
  using namespace cute;
  Tensor coords = local_tile(make_identity_tensor(make_shape(get<0>(problem_shape_mnkl), get<1>(problem_shape_mnkl))),
                             take<0, 2>(blk_shape_mnk), make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));
  return tiled_mma.get_thread_slice(thread_idx).partition_C(coords);  // (MMA, MMA_M, MMA_N) -> (m, n)
}

// acc += bias[col] in place for the columns < N (in float32: the logits' bias). A loop of its own: inside a select
// with anything else, ptxas hoisted the loads and spilled.
template <typename T, class Acc, class Coords>
CUTLASS_DEVICE void add_bias(Acc& acc, const Coords& tc, const void* bias_ptr, int N) {
  using TB = typename Cutlass<T>::type;
  const TB* bias = static_cast<const TB*>(bias_ptr);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) {
    const int col = cute::get<1>(tc(i));
    if (col < N) acc(i) += static_cast<float>(bias[col]);
  }
}

// f(idx, r, v0) on each element of a GMMA accumulator fragment (layout FrgLayout: ((2, 2, N/8), MMA_M, MMA_N)),
// columns outside and the thread's rows (r = 2 MMA_M + v1) inside, so consecutive calls feed different rows' chains;
// v0 is the element's place in its pair of adjacent columns. Fully unrolled: idx, r and v0 are constants.
template <class FrgLayout, class F>
CUTLASS_DEVICE void for_each_column_then_row(F&& f) {
  using namespace cute;
  constexpr int kV2 = size<0, 2>(FrgLayout{});
  constexpr int kMM = size<1>(FrgLayout{});
  constexpr int kMN = size<2>(FrgLayout{});
  CUTLASS_PRAGMA_UNROLL
  for (int mn = 0; mn < kMN; ++mn) {
    CUTLASS_PRAGMA_UNROLL
    for (int v2 = 0; v2 < kV2; ++v2) {
      CUTLASS_PRAGMA_UNROLL
      for (int v0 = 0; v0 < 2; ++v0) {
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < kMM; ++mm) {
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) f(make_coord(make_coord(v0, v1, v2), mm, mn), 2 * mm + v1, v0);
        }
      }
    }
  }
}

// The forward's epilogue: per (row, column tile) softmax partials (EpiloguePartialParams), no logit written.
template <typename T>
class SoftmaxPartialEpilogue : public AdapterEpilogue<EpiloguePartialParams> {
 public:
  using AdapterEpilogue<EpiloguePartialParams>::AdapterEpilogue;

  // every row has an id and a row of partials (the gradient's may be all padding: no ids)
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ids != nullptr && args.partial != nullptr;
  }

  // acc: the adapter's own copy of the accumulator fragment (Sm90TmaWarpSpecializedAdapter::store takes it by
  // value), dead after this call, so the bias and the vocabulary's end are folded into it in place.
  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int N = get<1>(problem_shape_mnkl);
    const long long tile_end = (static_cast<long long>(get<1>(blk_coord_mnkl)) + 1) * size<1>(blk_shape_mnk);
    // Every tile but a vocabulary's last, of a head without a bias (the LM heads of Llama, Qwen, ...), skips this:
    // a column check and a bias add per element inside the fold broke it into one basic block per element (no
    // instruction-level parallelism, the tensor cores idle behind it). Columns >= N become -inf: weight 0, never
    // the max, never a target.
    if (params_.bias != nullptr || tile_end > N) {
      auto tc = thread_coords(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma, thread_idx);
      if (params_.bias != nullptr) add_bias<T>(acc, tc, params_.bias, N);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        if (get<1>(tc(i)) >= N) acc(i) = -INFINITY;
      }
    }
    // two inlined variants only: four (a bias template too) made ptxas spill in every config
    if (params_.entropy) {
      fold<true>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
    } else {
      fold<false>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, acc, tiled_mma, thread_idx);
    }
  }

 private:
  // The accumulator of an sm90 GMMA with a float32 C: per thread ((2, 2, N/8), MMA_M, MMA_N), value mode
  // (v0: 2 adjacent columns, v1: rows r and r + 8, v2: the 8-column groups). A thread's row is set by (v1, MMA_M)
  // alone, and the 4 threads of a quad (lanes 4q .. 4q+3) hold the same rows' other columns: each thread folds its
  // columns of each of its rows, then the quad merges by shuffles (xor 1, xor 2). The (row, col) of every element
  // comes from CuTe's partition of an identity tensor, so only this grouping is assumed (static_asserts below).
  //
  // Loops run columns outside and the thread's rows (2 MMA_M) inside, with kParts partial maxima and sums per row:
  // at least 4 independent chains per pass, so the adds' latency hides. Partials are added in a fixed order,
  // so a row's result stays a function of that row alone. The target's logit is picked up off the hot loops, by the
  // threads whose tile holds it (1 tile in V / tile N per row). acc holds x (bias added, -inf past the vocabulary).
  template <bool ENTROPY, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
            class FrgEngine, class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void fold(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                           BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                           TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    static_assert(rank(FrgLayout{}) == 3, "accumulator: (MMA, MMA_M, MMA_N)");
    static_assert(rank<0>(FrgLayout{}) == 3, "GMMA accumulator value mode: (2, 2, N/8)");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "GMMA accumulator (2, 2, N/8)");
    constexpr int kMM = size<1>(FrgLayout{});
    constexpr int kRows = 2 * kMM;  // this thread's rows, r = 2 mm + v1
    // partial maxima and sums per row: two (by v0) where the thread has 2 rows, so 4 chains are in flight; one
    // where it has 4 (the ping-pong config's 128-row warpgroup tile), whose registers are all taken
    constexpr int kParts = kRows >= 4 ? 1 : 2;

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    Tensor tc = thread_coords(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma, thread_idx);
    static_assert(decltype(size(tc))::value == decltype(size(acc))::value, "accumulator / coordinate mismatch");
    const float c = params_.c;
    const int tile_idx = static_cast<int>(get<1>(blk_coord_mnkl));  // this column tile: the partial's index in its row
    const int col0 = tile_idx * static_cast<int>(size<1>(blk_shape_mnk));
    const int col_end = min(N, col0 + static_cast<int>(size<1>(blk_shape_mnk)));
    const bool quad_leader = (threadIdx.x % 4) == 0;
    // each row's id up front: the loads' latency hides under pass 1, and pass 3 uses them
    int row_of[kRows];
    int id_of[kRows];  // the target column, -1 where outside [0, N)
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = 2 * mm + v1;
        row_of[r] = get<0>(tc(make_coord(make_coord(0, v1, 0), mm, 0)));
        const long long id = row_of[r] < M ? params_.ids[row_of[r]] : -1;
        id_of[r] = id >= 0 && id < N ? static_cast<int>(id) : -1;
      }
    }

    // pass 1: the max of x over this thread's columns (times c after: c > 0 and rounding is monotonic, so
    // max(x) * c = max(x * c), as the fold kernel takes it); max is exact, so partials change nothing
    float mx[kRows][kParts];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kParts; ++q) mx[r][q] = -INFINITY;
    }
    for_each_column_then_row<FrgLayout>([&](auto idx, int r, int v0) {
      mx[r][v0 % kParts] = max_nan(mx[r][v0 % kParts], acc(idx));
    });
    // pass 2: sum-exp (and the entropy term) against each row's reference
    float neg_ref[kRows];
    RowState st[kRows];
    float s[kRows][kParts], t[kRows][kParts];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      st[r].m = (kParts == 2 ? max_nan(mx[r][0], mx[r][kParts - 1]) : mx[r][0]) * c;
      neg_ref[r] = -state_ref(st[r].m);
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kParts; ++q) s[r][q] = t[r][q] = 0.0f;
    }
    for_each_column_then_row<FrgLayout>([&](auto idx, int r, int v0) {
      const float d = fmaf(acc(idx), c, neg_ref[r]);
      const float e = fast_exp2(d);
      s[r][v0 % kParts] += e;
      if (ENTROPY) t[r][v0 % kParts] = fmaf(e, fmaxf(d, kExpFloor), t[r][v0 % kParts]);
    });
    // pass 3, rare: the target's x, in the threads of the one tile per row that holds it (an id outside [0, N) is
    // -1, in no tile; a column >= N is never an id)
    float xt[kRows];
    bool holds_target = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      xt[r] = 0.0f;
      holds_target |= id_of[r] >= col0 && id_of[r] < col_end;
    }
    if (holds_target) {
      for_each_column_then_row<FrgLayout>([&](auto idx, int r, int) {
        if (get<1>(tc(idx)) == id_of[r]) xt[r] = acc(idx);
      });
    }
    // the quad's merge: symmetric (merge_state), so all four lanes agree; the target's x is 0 in all but (at
    // most) one lane, and x + 0 = x
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      st[r].s = kParts == 2 ? s[r][0] + s[r][kParts - 1] : s[r][0];
      st[r].t = !ENTROPY ? 0.0f : kParts == 2 ? t[r][0] + t[r][kParts - 1] : t[r][0];
      CUTLASS_PRAGMA_UNROLL
      for (int off = 1; off <= 2; off *= 2) {
        RowState o;
        o.m = __shfl_xor_sync(0xffffffffu, st[r].m, off);
        o.s = __shfl_xor_sync(0xffffffffu, st[r].s, off);
        o.t = ENTROPY ? __shfl_xor_sync(0xffffffffu, st[r].t, off) : 0.0f;
        st[r] = merge_state<ENTROPY>(st[r], o);
        xt[r] += __shfl_xor_sync(0xffffffffu, xt[r], off);
      }
      if (row_of[r] < M && quad_leader) {
        params_.partial[static_cast<long long>(row_of[r]) * params_.tiles + tile_idx] =
            make_float4(st[r].m, st[r].s, st[r].t, xt[r]);
      }
    }
  }
};

// The backward's epilogue: the gradient of the row losses with respect to this tile's logits, formed from the
// float32 accumulator (+ the bias) and the forward's stats, rounded once to T and stored to `out`, the dW / dH
// GEMMs' operand: no logits tile is written or read. Per element, rlkernel_linear_logp_grad_kernel's formula
// (row_grad.cuh) but for log2 p, one fma here where the grad kernel rounds (x c - r) - log2 s:
//   log2 p = x c - (r + log2 s),  g = p (A + B max(log2 p, -256)) (+ G at the target column);
// 0 on ignored and padding rows, NaN on a bad id (the forward reported it). Columns >= N are not stored.
template <typename T>
class SoftmaxGradEpilogue : public AdapterEpilogue<EpilogueGradParams> {
 public:
  using AdapterEpilogue<EpilogueGradParams>::AdapterEpilogue;

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    auto tc = thread_coords(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma, thread_idx);
    const int N = cute::get<1>(problem_shape_mnkl);
    if (params_.bias != nullptr) add_bias<T>(acc, tc, params_.bias, N);
    // every tile but the chunk's last, with an output whose rows start 4-byte aligned: each thread's column pairs
    // (v0) start at even columns, so every pair is one 32-bit store with no check
    const long long tile_end =
        (static_cast<long long>(cute::get<1>(blk_coord_mnkl)) + 1) * cute::size<1>(blk_shape_mnk);
    const bool pairs = params_.pairs_aligned && tile_end <= N && cute::get<1>(tc(0)) % 2 == 0;
    if (params_.in.grad_entropy != nullptr) {
      pairs ? store_grad<true, true>(problem_shape_mnkl, acc, tc)
            : store_grad<true, false>(problem_shape_mnkl, acc, tc);
    } else {
      pairs ? store_grad<false, true>(problem_shape_mnkl, acc, tc)
            : store_grad<false, false>(problem_shape_mnkl, acc, tc);
    }
  }

 private:
  // Loops: the thread's rows outside (each row's coefficients, id and output row once), its columns inside, two
  // adjacent columns (v0) per 32-bit store (PAIRS: all of them; else where both are < N and aligned). Rows >= M
  // are not this GEMM's.
  template <bool HAS_GH, bool PAIRS, class ProblemShapeMNKL, class FrgEngine, class FrgLayout, class Coords>
  CUTLASS_DEVICE void store_grad(ProblemShapeMNKL problem_shape_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 const Coords& tc) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "accumulator: ((2, 2, N/8), MMA_M, MMA_N)");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "GMMA accumulator (2, 2, N/8)");
    constexpr int kV2 = size<0, 2>(FrgLayout{});
    constexpr int kMM = size<1>(FrgLayout{});
    constexpr int kMN = size<2>(FrgLayout{});
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const EpilogueGradParams& p = params_;
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = get<0>(tc(make_coord(make_coord(0, v1, 0), mm, 0)));
        if (row >= M) continue;
        const bool pad = row >= p.n_rows;
        const long long id = pad ? p.ignore_index : p.ids[row];
        const bool ignored = id == p.ignore_index;
        const bool bad = !ignored && (id < 0 || id >= p.vocab);
        RowGradCoeffs k{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (!ignored && !bad) k = row_grad_coeffs<HAS_GH>(p.in, row, p.inv_t);
        // an ignored or padding row: 0, so the GEMMs get nothing from it; a bad id: NaN
        const bool fill = ignored || bad;
        const float fill_value = ignored ? 0.0f : NAN;
        const float neg_base = -(k.ref + k.log2s);
        // the target as an offset from this thread's first column: each element's offset is then a constant (no
        // add per element for the compare); INT_MIN where no column of this row in the tile is the target
        const int col_base = get<1>(tc(0));
        int target = INT_MIN;
        if (!fill && id >= p.col0 && id < p.col0 + N) target = static_cast<int>(id - p.col0) - col_base;
        unsigned short* out_row = static_cast<unsigned short*>(p.out) + static_cast<long long>(row) * p.out_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int mn = 0; mn < kMN; ++mn) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < kV2; ++v2) {
            unsigned short bits[2];
            int col[2];
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < 2; ++v0) {
              const auto idx = make_coord(make_coord(v0, v1, v2), mm, mn);
              col[v0] = get<1>(tc(idx));
              const float lp = fmaf(acc(idx), p.c, neg_base);  // log2 p
              const float pr = fast_exp2(lp);
              float g = HAS_GH ? pr * fmaf(k.B, fmaxf(lp, kExpFloor), k.A) : pr * k.A;
              if (col[v0] - col_base == target) g += k.G;
              bits[v0] = bits16(from_float<T>(fill ? fill_value : g));
            }
            unsigned short* dst = out_row + col[0];
            if (PAIRS || (col[1] == col[0] + 1 && col[1] < N && (reinterpret_cast<uintptr_t>(dst) & 3u) == 0)) {
              *reinterpret_cast<unsigned int*>(dst) = bits[0] | (static_cast<unsigned int>(bits[1]) << 16);
            } else {
              CUTLASS_PRAGMA_UNROLL
              for (int v0 = 0; v0 < 2; ++v0)
                if (col[v0] < N) out_row[col[v0]] = bits[v0];
            }
          }
        }
      }
    }
  }
};

}  // namespace epilogue_gemm
}  // namespace rlkernel
