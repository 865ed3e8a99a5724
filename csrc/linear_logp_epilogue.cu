// The epilogue GEMM of the fused LM head (issue 37): logits tile = hidden[rows] @ weight[cols]^T on Hopper (CUTLASS
// 3.x sm90 TMA warp-specialized mainloop, wgmma, float32 accumulator), with an epilogue of our own; the two epilogue
// collectives are in rlkernel/linear_logp_epilogues.cuh, the configs, launches and the merge kernel here.
// - The forward (linear_logp_epilogue): the epilogue folds the accumulator tile in registers into per-(row, column
//   tile) online-softmax partials (max, sum-exp, entropy term, target logit) and never writes a logit;
//   rlkernel_linear_logp_epilogue_merge_kernel then merges a row's partials into logp / entropy / stats exactly as
//   the last step of rlkernel_linear_logp_fold_kernel does.
// - The backward (linear_logp_grad_epilogue, rlkernel_linear_logp_grad_epilogue_gemm_kernel): the recompute GEMM of a
//   chunk whose epilogue writes the logits' 16-bit gradient, the dW / dH GEMMs' operand.
//
// - Logits are the float32 accumulator (+ the bias in float32), both for logits_dtype = the inputs' dtype and for
//   float32: there is no 16-bit logit tile to round to.
// - wgmma / TMA code is compiled only in the sm_90a device pass (__CUDA_ARCH_FEAT_SM90_ALL); the sm_80 pass gets an
//   empty kernel body (never launched: the launcher refuses any GPU but compute capability 9.0).
// - Without the CUTLASS headers (the nvidia-cutlass wheel's cutlass_library/source/include on the include path) the
//   launchers only return "epilogue GEMM: rlkernel._C was built without the CUTLASS headers (...)" and the op keeps
//   the cuBLAS path.
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

#include "rlkernel/linear_logp_epilogues.cuh"  // the two epilogue collectives
#else
#define RLKERNEL_HAS_CUTLASS 0
#endif

namespace rlkernel {

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

// hidden [M, K] (row major) @ weight [N, K]^T with the epilogue collective Epi<T>
template <typename T, class Config, template <typename> class Epi>
struct Gemm {
  using TB = typename Cutlass<T>::type;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epi<T>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TB, cutlass::layout::RowMajor, kAlign, TB,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi<T>::SharedStorage))>,
      typename Config::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
};

}  // namespace epilogue_gemm

// cutlass::device_kernel under rlkernel_* names (contract 3: the trace reads these ranges as fused), one per
// epilogue so a trace tells the forward's from the backward's; the bodies only in the sm_90a pass.
template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    rlkernel_linear_logp_epilogue_gemm_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
#endif
}

template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    rlkernel_linear_logp_grad_epilogue_gemm_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  Kernel op;
  op(params, smem);
#endif
}

namespace {

// The operands of one epilogue GEMM launch: hidden [m, k] (row stride hidden_stride) @ weight [n, k]^T.
struct GemmOperands {
  const void* hidden;
  int64_t hidden_stride;
  const void* weight;
  int m, n, k;
  int device;
  int sm_count;
  cudaStream_t stream;
};

template <typename T, class Config, template <typename> class Epi, class Kernel>
const char* launch_gemm(const GemmOperands& g, const typename Epi<T>::Params& ep, Kernel* kernel) {
  using G = epilogue_gemm::Gemm<T, Config, Epi>;
  using K = typename G::Kernel;
  using TB = typename G::TB;
  using StrideA = typename K::StrideA;
  using StrideB = typename K::StrideB;
  StrideA stride_a = cute::make_stride(static_cast<int64_t>(g.hidden_stride), cute::Int<1>{}, int64_t{0});
  StrideB stride_b = cute::make_stride(static_cast<int64_t>(g.k), cute::Int<1>{}, int64_t{0});
  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device;
  hw.sm_count = g.sm_count;
  typename K::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {g.m, g.n, g.k, 1},
                             {static_cast<const TB*>(g.hidden), stride_a, static_cast<const TB*>(g.weight), stride_b},
                             ep,
                             hw};
  if (!K::can_implement(args)) return "epilogue GEMM: CUTLASS cannot implement this problem";
  if (K::get_workspace_size(args) != 0) return "epilogue GEMM: the kernel asks for a workspace";
  typename K::Params params = K::to_underlying_arguments(args, nullptr);
  const int smem = K::SharedStorageSize;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return launch::last_error();
  }
  using Cluster = typename Config::ClusterShape;
  constexpr unsigned cluster_m = cute::size<0>(Cluster{}), cluster_n = cute::size<1>(Cluster{});
  if constexpr (cluster_m * cluster_n == 1) {
    kernel<<<K::get_grid_shape(params), K::get_block_shape(), smem, g.stream>>>(params);
  } else {  // a cluster launch (the grid is a whole number of clusters: the tile scheduler's grid)
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = K::get_grid_shape(params);
    cfg.blockDim = K::get_block_shape();
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = g.stream;
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

// The two epilogues' launches, as dispatch's Launch<T, Config>::run: each kernel under its own rlkernel_* name.
template <typename T, class Config> struct Forward {
  static const char* run(const GemmOperands& g, const EpiloguePartialParams& ep) {
    using K = typename epilogue_gemm::Gemm<T, Config, epilogue_gemm::SoftmaxPartialEpilogue>::Kernel;
    return launch_gemm<T, Config, epilogue_gemm::SoftmaxPartialEpilogue>(
        g, ep, &rlkernel_linear_logp_epilogue_gemm_kernel<K>);
  }
};
template <typename T, class Config> struct Backward {
  static const char* run(const GemmOperands& g, const EpilogueGradParams& ep) {
    using K = typename epilogue_gemm::Gemm<T, Config, epilogue_gemm::SoftmaxGradEpilogue>::Kernel;
    return launch_gemm<T, Config, epilogue_gemm::SoftmaxGradEpilogue>(
        g, ep, &rlkernel_linear_logp_grad_epilogue_gemm_kernel<K>);
  }
};

// The checks both entry points share; nullptr where the GEMM can run, else why not. Fills g's device fields.
const char* gemm_operands(const void* hidden, int64_t hidden_stride, const void* weight, int64_t m, int64_t n,
                          int64_t k, int config, int device, void* stream, GemmOperands* g) {
  if (config < 0 || config > 2) return "epilogue GEMM: config must be 0, 1 or 2";
  int major = 0, minor = 0, sms = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return launch::last_error();
  }
  if (major != 9 || minor != 0) return "epilogue GEMM: needs a compute capability 9.0 GPU (sm_90a)";
  // int coordinates in the epilogues, a tile past the last column included: N, V <= 2^31 - 257; k > 0 (a GEMM
  // with no k-block would wait on a stage its producer never fills)
  constexpr int64_t kMaxMN = (int64_t{1} << 31) - 257;
  if (m > kMaxMN || n > kMaxMN || k <= 0 || k % 8 != 0 || hidden_stride % 8 != 0) {
    return "epilogue GEMM: shape outside the kernel (N, V < 2^31 - 256; H > 0 and H and the row stride multiples "
           "of 8)";
  }
  if ((reinterpret_cast<uintptr_t>(hidden) | reinterpret_cast<uintptr_t>(weight)) % 16 != 0) {
    return "epilogue GEMM: hidden and weight must be 16-byte aligned (TMA)";
  }
  *g = GemmOperands{hidden, hidden_stride, weight, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                    device, sms, static_cast<cudaStream_t>(stream)};
  return nullptr;
}

// One dispatch by dtype and config for both epilogues: bf16 in the three configs, fp16 in config 0.
template <template <typename, class> class Launch, class P>
const char* dispatch(ElemType dtype, int config, const GemmOperands& g, const P& ep) {
  if (dtype == ElemType::kBFloat16) {
    return config == 1   ? Launch<__nv_bfloat16, epilogue_gemm::PingPong>::run(g, ep)
           : config == 2 ? Launch<__nv_bfloat16, epilogue_gemm::CooperativeCluster2>::run(g, ep)
                         : Launch<__nv_bfloat16, epilogue_gemm::Cooperative>::run(g, ep);
  }
  if (dtype == ElemType::kFloat16) {
    if (config != 0) return "epilogue GEMM: configs 1 and 2 are built for bfloat16 only";
    return Launch<__half, epilogue_gemm::Cooperative>::run(g, ep);
  }
  return "epilogue GEMM: bfloat16 / float16 inputs only";
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
  GemmOperands g;
  if (const char* why = gemm_operands(a.hidden, a.hidden_stride, a.weight, a.n_rows, a.vocab, a.hidden_size,
                                      a.config, a.device, a.stream, &g)) {
    return why;
  }
  EpiloguePartialParams ep;
  ep.bias = a.bias;
  ep.ids = reinterpret_cast<const long long*>(a.ids);
  ep.partial = reinterpret_cast<float4*>(a.partial);
  ep.tiles = static_cast<int>(linear_logp_epilogue_tiles(a.vocab, a.config));
  ep.c = launch::log2e_over(a.temperature);
  ep.entropy = a.entropy != nullptr;
  if (const char* err = dispatch<Forward>(a.dtype, a.config, g, ep)) return err;
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
    rlkernel_linear_logp_epilogue_merge_kernel<true><<<grid, kMergeThreads, 0, g.stream>>>(p);
  } else {
    rlkernel_linear_logp_epilogue_merge_kernel<false><<<grid, kMergeThreads, 0, g.stream>>>(p);
  }
  return launch::last_error();
#else
  return "epilogue GEMM: rlkernel._C was built without the CUTLASS headers (pip install nvidia-cutlass)";
#endif
}

const char* linear_logp_grad_epilogue(const LinearGradEpilogueArgs& a) {
  if (a.tile_rows == 0 || a.cols == 0) return nullptr;
#if RLKERNEL_HAS_CUTLASS
  GemmOperands g;
  if (const char* why = gemm_operands(a.hidden, a.hidden_stride, a.weight, a.tile_rows, a.cols, a.hidden_size,
                                      a.config, a.device, a.stream, &g)) {
    return why;
  }
  EpilogueGradParams ep;
  ep.bias = a.bias;
  ep.ids = reinterpret_cast<const long long*>(a.ids);
  ep.n_rows = a.n_rows;
  ep.col0 = a.col0;
  ep.vocab = a.vocab;
  ep.ignore_index = a.ignore_index;
  ep.c = launch::log2e_over(a.temperature);
  ep.inv_t = launch::inverse(a.temperature);
  ep.in = launch::row_grad_inputs(a);
  ep.out = a.out;
  ep.out_stride = a.out_stride;
  ep.pairs_aligned = reinterpret_cast<uintptr_t>(a.out) % 4 == 0 && a.out_stride % 2 == 0;
  return dispatch<Backward>(a.dtype, a.config, g, ep);
#else
  return "epilogue GEMM: rlkernel._C was built without the CUTLASS headers (pip install nvidia-cutlass)";
#endif
}

}  // namespace rlkernel
