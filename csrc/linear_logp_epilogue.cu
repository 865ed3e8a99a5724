// The epilogue GEMM of the fused LM-head forward (issue 37): logits tile = hidden[rows] @ weight[cols]^T on Hopper
// (CUTLASS 3.x sm90 TMA warp-specialized cooperative mainloop, wgmma, float32 accumulator), whose epilogue folds the
// accumulator tile in registers into per-(row, column tile) online-softmax partials (max, sum-exp, entropy term,
// target logit) and never writes a logit; rlkernel_linear_logp_epilogue_merge_kernel then merges a row's partials
// into logp / entropy / stats exactly as the last step of rlkernel_linear_logp_fold_kernel does.
//
// - Logits are the float32 accumulator (+ the bias in float32), both for logits_dtype = the inputs' dtype and for
//   float32: there is no 16-bit logit tile to round to.
// - wgmma / TMA code is compiled only in the sm_90a device pass (__CUDA_ARCH_FEAT_SM90_ALL); the sm_80 pass gets an
//   empty kernel body (never launched: the launcher refuses any GPU but compute capability 9.0).
// - Without the CUTLASS headers (the nvidia-cutlass wheel's cutlass_library/source/include on the include path) the
//   launcher only returns "built without CUTLASS" and the op falls back to the cuBLAS path.
// - Deterministic and row-independent: no split-K / stream-K (the persistent data-parallel tile scheduler), every
//   row's partials are reduced in a fixed order, so a row's results depend neither on N nor on its position.
// NDEBUG before any include: CUTLASS / CuTe's device asserts are calls (__assertfail) inside the mainloop, and a call
// there makes ptxas serialize every wgmma (C7510, "wgmma pipeline crossing function boundary"); torch's extension
// build does not define it for nvcc.
#ifndef NDEBUG
#define NDEBUG 1
#endif

#include <cuda_runtime.h>

#include <cstdint>

#include "rlkernel/error_record.cuh"
#include "rlkernel/launch.cuh"
#include "rlkernel/linear_logp_api.h"
#include "rlkernel/row_reduce.cuh"

#if __has_include(<cute/tensor.hpp>) && __has_include(<cutlass/gemm/collective/collective_builder.hpp>)
#define RLKERNEL_HAS_CUTLASS 1
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/numeric_types.h>
#else
#define RLKERNEL_HAS_CUTLASS 0
#endif

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

struct EpilogueMergeParams {
  const float4* partial;   // [n_rows, tiles]
  int tiles;
  int tile_n;              // columns per tile (the target's tile: id / tile_n)
  const long long* ids;
  long long n_rows;
  long long vocab;
  float c;
  long long ignore_index;
  float* logp;
  float* entropy;          // nullptr: no entropy
  float2* stats;
  long long row0;
  ErrorSink errors;
};

constexpr int kMergeThreads = 256;  // 8 warps, one row each

// One warp per row: lanes merge tiles lane, lane + 32, ... in order, then the symmetric butterfly (warp_merge):
// a fixed order for every row. Finishes exactly like the fold kernel's last chunk.
template <bool ENTROPY>
__global__ void __launch_bounds__(kMergeThreads) rlkernel_linear_logp_epilogue_merge_kernel(
    const EpilogueMergeParams p) {
  const long long row = static_cast<long long>(blockIdx.x) * (kMergeThreads / 32) + threadIdx.x / 32;
  if (row >= p.n_rows) return;  // whole warps leave together (warp_merge needs all 32 lanes)
  const int lane = threadIdx.x % 32;
  const long long id = p.ids[row];
  const bool ignored = id == p.ignore_index;
  const bool bad = !ignored && (id < 0 || id >= p.vocab);
  if (ignored || bad) {
    if (lane == 0) {
      const float fill = ignored ? 0.0f : NAN;
      p.logp[row] = fill;
      if (ENTROPY) p.entropy[row] = fill;
      p.stats[row] = make_float2(fill, fill);
      if (bad) report_error(p.errors, p.row0 + row, id);
    }
    return;
  }
  const float4* part = p.partial + row * p.tiles;
  RowState st = empty_state();
  for (int j = lane; j < p.tiles; j += 32) {
    const float4 q = part[j];
    st = merge_state<ENTROPY>(st, RowState{q.x, q.y, ENTROPY ? q.z : 0.0f});
  }
  st = warp_merge<ENTROPY>(st);
  if (lane != 0) return;
  const float target = part[id / p.tile_n].w;
  const RowResult r = finish_row<ENTROPY>(st);
  p.logp[row] = target_logp(target, p.c, r);
  if (ENTROPY) p.entropy[row] = r.entropy;
  p.stats[row] = make_float2(r.ref, r.log2s);
}

#if RLKERNEL_HAS_CUTLASS
namespace epilogue_gemm {

template <typename T> struct Cutlass;
template <> struct Cutlass<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct Cutlass<__half> { using type = cutlass::half_t; };

// The custom epilogue: an sm70-style collective (operator() on the accumulator fragment), run by sm90
// warp-specialized kernels through Sm90TmaWarpSpecializedAdapter (no shared memory, no TMA store).
template <typename T>
class SoftmaxPartialEpilogue {
 public:
  using ElementC = float;  // unused (no C operand): the kernel only names these types
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = EpiloguePartialParams;
  using Params = EpiloguePartialParams;

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
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ids != nullptr && args.partial != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit SoftmaxPartialEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

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
      using TB = typename Cutlass<T>::type;
      const TB* bias = static_cast<const TB*>(params_.bias);
      Tensor coords = local_tile(make_identity_tensor(make_shape(get<0>(problem_shape_mnkl), N)),
                                 take<0, 2>(blk_shape_mnk), make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));
      Tensor tc = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);
      // two loops: one select of the bias add and the -inf made ptxas hoist the loads and spill
      if (bias != nullptr) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          const int col = get<1>(tc(i));
          if (col < N) acc(i) += static_cast<float>(bias[col]);
        }
      }
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
  Params params_;

  // The accumulator of an sm90 GMMA with a float32 C: per thread ((2, 2, N/8), MMA_M, MMA_N), value mode
  // (v0: 2 adjacent columns, v1: rows r and r + 8, v2: the 8-column groups). A thread's row is set by (v1, MMA_M)
  // alone, and the 4 threads of a quad (lanes 4q .. 4q+3) hold the same rows' other columns: each thread folds its
  // columns of each of its rows, then the quad merges by shuffles (xor 1, xor 2). The (row, col) of every element
  // comes from CuTe's partition of an identity tensor, so only this grouping is assumed (static_asserts below).
  //
  // Loops run columns outside and the thread's rows (2 MMA_M) inside, with kParts partial maxima and sums per row:
  // at least 4 independent chains per pass, so the adds' latency hides. Partials are added in a fixed order,
  // so a row's result stays a function of that row alone. The target's logit is picked up off the hot loops, by the
  // threads whose tile holds it (1 tile in V / 256 per row). acc holds x (bias added, -inf past the vocabulary).
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
    constexpr int kV2 = size<0, 2>(FrgLayout{});
    constexpr int kMM = size<1>(FrgLayout{});
    constexpr int kMN = size<2>(FrgLayout{});
    constexpr int kRows = 2 * kMM;  // this thread's rows, r = 2 mm + v1
    // partial maxima and sums per row: two (by v0) where the thread has 2 rows, so 4 chains are in flight; one
    // where it has 4 (the ping-pong config's 128-row warpgroup tile), whose registers are all taken
    constexpr int kParts = kRows >= 4 ? 1 : 2;

    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    Tensor coords = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_mnk),
                               make_coord(m_coord, n_coord));                   // (BLK_M, BLK_N) -> (m, n)
    Tensor tc = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);    // (MMA, MMA_M, MMA_N)
    static_assert(decltype(size(tc))::value == decltype(size(acc))::value, "accumulator / coordinate mismatch");
    const float c = params_.c;
    const int tile_idx = static_cast<int>(n_coord);  // this column tile: the partial's index in its row
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
    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < kMN; ++mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < kV2; ++v2) {
        CUTLASS_PRAGMA_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) {
          CUTLASS_PRAGMA_UNROLL
          for (int mm = 0; mm < kMM; ++mm) {
            CUTLASS_PRAGMA_UNROLL
            for (int v1 = 0; v1 < 2; ++v1) {
              const auto idx = make_coord(make_coord(v0, v1, v2), mm, mn);
              mx[2 * mm + v1][v0 % kParts] = max_nan(mx[2 * mm + v1][v0 % kParts], acc(idx));
            }
          }
        }
      }
    }
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
    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < kMN; ++mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < kV2; ++v2) {
        CUTLASS_PRAGMA_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) {
          CUTLASS_PRAGMA_UNROLL
          for (int mm = 0; mm < kMM; ++mm) {
            CUTLASS_PRAGMA_UNROLL
            for (int v1 = 0; v1 < 2; ++v1) {
              const auto idx = make_coord(make_coord(v0, v1, v2), mm, mn);
              const int r = 2 * mm + v1;
              const float d = fmaf(acc(idx), c, neg_ref[r]);
              const float e = fast_exp2(d);
              s[r][v0 % kParts] += e;
              if (ENTROPY) t[r][v0 % kParts] = fmaf(e, fmaxf(d, kExpFloor), t[r][v0 % kParts]);
            }
          }
        }
      }
    }
    // pass 3, rare: the target's x, in the threads of the one tile per row that holds it (an id outside [0, N)
    // in none)
    float xt[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = 2 * mm + v1;
        xt[r] = 0.0f;
        if (id_of[r] >= col0 && id_of[r] < col_end) {
          const int target = id_of[r];
          CUTLASS_PRAGMA_UNROLL
          for (int mn = 0; mn < kMN; ++mn) {
            CUTLASS_PRAGMA_UNROLL
            for (int v2 = 0; v2 < kV2; ++v2) {
              CUTLASS_PRAGMA_UNROLL
              for (int v0 = 0; v0 < 2; ++v0) {
                const auto idx = make_coord(make_coord(v0, v1, v2), mm, mn);
                if (get<1>(tc(idx)) == target) xt[r] = acc(idx);
              }
            }
          }
        }
      }
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

// Three configs, stages by what shared memory holds, 128 accumulator registers per thread in each:
// 0 (cooperative): 128 x 256 x 64 tiles, 2 consumer warpgroups of 64 x 256 each; the epilogue stalls the tensor cores;
// 1 (ping-pong, bf16 only): 128 x 128 x 64 tiles, one warpgroup per tile, the two alternating, so one's epilogue runs
//   under the other's mainloop;
// 2 (cooperative, cluster 2 x 1, bf16 only): config 0 with pairs of CTAs along M sharing each weight tile (TMA
//   multicast: half the weight's L2 reads), launched as clusters.
using Cluster1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
struct Cooperative {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using ClusterShape = Cluster1;
  static constexpr int kTileN = 256;
};
struct PingPong {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Schedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using ClusterShape = Cluster1;
  static constexpr int kTileN = 128;
};
struct CooperativeCluster2 : Cooperative {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
constexpr int kAlign = 8;  // 16 bytes of 16-bit elements: TMA's stride alignment

template <typename T, class Config>
struct Gemm {
  using TB = typename Cutlass<T>::type;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SoftmaxPartialEpilogue<T>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TB, cutlass::layout::RowMajor, kAlign, TB,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename SoftmaxPartialEpilogue<T>::SharedStorage))>,
      typename Config::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
};

}  // namespace epilogue_gemm

// cutlass::device_kernel under an rlkernel_* name (contract 3: the trace reads this range as fused); the body only
// in the sm_90a pass.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    rlkernel_linear_logp_epilogue_gemm_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
#endif
}

namespace {

template <typename T, class Config>
const char* launch_gemm(const LinearEpilogueArgs& a, cudaStream_t stream, int sm_count) {
  using G = epilogue_gemm::Gemm<T, Config>;
  using K = typename G::Kernel;
  using TB = typename G::TB;
  using StrideA = typename K::StrideA;
  using StrideB = typename K::StrideB;
  const int m = static_cast<int>(a.n_rows), n = static_cast<int>(a.vocab), k = static_cast<int>(a.hidden_size);
  StrideA stride_a = cute::make_stride(static_cast<int64_t>(a.hidden_stride), cute::Int<1>{}, int64_t{0});
  StrideB stride_b = cute::make_stride(static_cast<int64_t>(k), cute::Int<1>{}, int64_t{0});
  EpiloguePartialParams ep;
  ep.bias = a.bias;
  ep.ids = reinterpret_cast<const long long*>(a.ids);
  ep.partial = reinterpret_cast<float4*>(a.partial);
  ep.tiles = static_cast<int>(linear_logp_epilogue_tiles(a.vocab, a.config));
  ep.c = launch::log2e_over(a.temperature);
  ep.entropy = a.entropy != nullptr;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device;
  hw.sm_count = sm_count;
  typename K::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {m, n, k, 1},
                             {static_cast<const TB*>(a.hidden), stride_a, static_cast<const TB*>(a.weight), stride_b},
                             ep,
                             hw};
  if (!K::can_implement(args)) return "epilogue GEMM: CUTLASS cannot implement this problem";
  if (K::get_workspace_size(args) != 0) return "epilogue GEMM: the kernel asks for a workspace";
  typename K::Params params = K::to_underlying_arguments(args, nullptr);
  const int smem = K::SharedStorageSize;
  auto* kernel = &rlkernel_linear_logp_epilogue_gemm_kernel<K>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return launch::last_error();
  }
  using Cluster = typename Config::ClusterShape;
  constexpr unsigned cluster_m = cute::size<0>(Cluster{}), cluster_n = cute::size<1>(Cluster{});
  if constexpr (cluster_m * cluster_n == 1) {
    kernel<<<K::get_grid_shape(params), K::get_block_shape(), smem, stream>>>(params);
  } else {  // a cluster launch (the grid is a whole number of clusters: the tile scheduler's grid)
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = K::get_grid_shape(params);
    cfg.blockDim = K::get_block_shape();
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster_m;
    attr[0].val.clusterDim.y = cluster_n;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, params) != cudaSuccess) return launch::last_error();
  }
  return launch::last_error();
}

}  // namespace
#endif  // RLKERNEL_HAS_CUTLASS

int64_t linear_logp_epilogue_tile_n(int config) { return config == 1 ? 128 : 256; }  // 0, 2: 256

int64_t linear_logp_epilogue_tiles(int64_t vocab, int config) {
  const int64_t n = linear_logp_epilogue_tile_n(config);
  return (vocab + n - 1) / n;
}

bool linear_logp_epilogue_built() { return RLKERNEL_HAS_CUTLASS != 0; }

const char* linear_logp_epilogue(const LinearEpilogueArgs& a) {
  if (a.n_rows == 0) return nullptr;
#if RLKERNEL_HAS_CUTLASS
  static_assert(epilogue_gemm::Cooperative::kTileN == 256 && epilogue_gemm::PingPong::kTileN == 128 &&
                epilogue_gemm::CooperativeCluster2::kTileN == 256, "linear_logp_epilogue_tile_n");
  if (a.config < 0 || a.config > 2) return "epilogue GEMM: config must be 0, 1 or 2";
  auto stream = static_cast<cudaStream_t>(a.stream);
  int major = 0, minor = 0, sms = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a.device) != cudaSuccess) {
    return launch::last_error();
  }
  if (major != 9 || minor != 0) return "epilogue GEMM: needs a compute capability 9.0 GPU (sm_90a)";
  if (a.n_rows >= (int64_t{1} << 31) || a.vocab >= (int64_t{1} << 31) || a.hidden_size % 8 != 0 ||
      a.hidden_stride % 8 != 0) {
    return "epilogue GEMM: shape outside the kernel (N, V < 2^31; H and the row stride multiples of 8)";
  }
  if ((reinterpret_cast<uintptr_t>(a.hidden) | reinterpret_cast<uintptr_t>(a.weight)) % 16 != 0) {
    return "epilogue GEMM: hidden and weight must be 16-byte aligned (TMA)";
  }
  const char* err = nullptr;
  if (a.dtype == ElemType::kBFloat16) {
    err = a.config == 1   ? launch_gemm<__nv_bfloat16, epilogue_gemm::PingPong>(a, stream, sms)
          : a.config == 2 ? launch_gemm<__nv_bfloat16, epilogue_gemm::CooperativeCluster2>(a, stream, sms)
                          : launch_gemm<__nv_bfloat16, epilogue_gemm::Cooperative>(a, stream, sms);
  } else if (a.dtype == ElemType::kFloat16) {
    if (a.config != 0) return "epilogue GEMM: configs 1 and 2 are built for bfloat16 only";
    err = launch_gemm<__half, epilogue_gemm::Cooperative>(a, stream, sms);
  } else {
    return "epilogue GEMM: bfloat16 / float16 inputs only";
  }
  if (err) return err;
  EpilogueMergeParams p;
  p.partial = reinterpret_cast<const float4*>(a.partial);
  p.tiles = static_cast<int>(linear_logp_epilogue_tiles(a.vocab, a.config));
  p.tile_n = static_cast<int>(linear_logp_epilogue_tile_n(a.config));
  p.ids = reinterpret_cast<const long long*>(a.ids);
  p.n_rows = a.n_rows;
  p.vocab = a.vocab;
  p.c = launch::log2e_over(a.temperature);
  p.ignore_index = a.ignore_index;
  p.logp = a.logp;
  p.entropy = a.entropy;
  p.stats = reinterpret_cast<float2*>(a.stats);
  p.row0 = a.row0;
  p.errors = a.errors;
  const unsigned grid = static_cast<unsigned>((a.n_rows + kMergeThreads / 32 - 1) / (kMergeThreads / 32));
  if (a.entropy != nullptr) {
    rlkernel_linear_logp_epilogue_merge_kernel<true><<<grid, kMergeThreads, 0, stream>>>(p);
  } else {
    rlkernel_linear_logp_epilogue_merge_kernel<false><<<grid, kMergeThreads, 0, stream>>>(p);
  }
  return launch::last_error();
#else
  return "epilogue GEMM: rlkernel._C was built without the CUTLASS headers (pip install nvidia-cutlass)";
#endif
}

}  // namespace rlkernel
