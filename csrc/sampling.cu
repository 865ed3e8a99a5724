// Launchers of the fused sampler. No torch include (the CI compile gate builds this with nvcc alone).
// sample_launch opens the NVTX op range rlkernel:op.sample around everything it puts on the stream: the
// rlkernel_* kernels, nothing else (rows without a distribution go to the device's error record from inside them).
#include <cuda_runtime.h>
#include <nvtx3/nvtx3.hpp>

#include <mutex>

#include "rlkernel/sampling_api.cuh"
#include "rlkernel/sampling_kernels.cuh"

namespace rlkernel {
namespace {

using namespace sampling;

struct NvtxDomain {
  static constexpr char const* name{"rlkernel"};
};
struct SampleMessage {
  static constexpr char const* message{"op.sample"};
};

int64_t splits_for(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }

// The candidate path needs a small k (or T = 0) and at most one chunk per thread of the select block.
bool use_fast_path(int64_t vocab, float temperature, int64_t top_k) {
  const bool small_k = temperature == 0.f || (top_k >= 1 && top_k <= kMaxFastK && top_k < vocab);
  return small_k && splits_for(vocab) <= kRowThreads;
}

// What the fast path's launches need to know about a device, found once per device and element type: the
// candidates kernel's dynamic shared memory opt-in, its resident blocks (the persistent grid), and whether
// programmatic dependent launch exists (compute capability 9+).
struct FastPathDevice {
  cudaError_t err = cudaSuccess;
  int major = 0;
  int candidate_blocks = 0;  // resident candidates blocks on the whole device
};
constexpr int kMaxDevices = 64;

template <typename T>
const FastPathDevice& fast_path_device(int device) {
  static std::once_flag once[kMaxDevices];
  static FastPathDevice info[kMaxDevices];
  std::call_once(once[device], [device] {
    FastPathDevice& d = info[device];
    constexpr int smem = static_cast<int>(kStages * kStageBytes<T>);
    int sms = 0, per_sm = 0;
    d.err = cudaFuncSetAttribute(rlkernel_sample_candidates<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (d.err == cudaSuccess) d.err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (d.err == cudaSuccess) d.err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (d.err == cudaSuccess) {
      d.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rlkernel_sample_candidates<T>, kCandThreads,
                                                            smem);
    }
    d.candidate_blocks = per_sm * sms;
    if (d.err == cudaSuccess && d.candidate_blocks == 0) d.err = cudaErrorInvalidConfiguration;
  });
  return info[device];
}

template <typename T>
const char* launch_typed(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride, float temperature,
                         int64_t top_k, double top_p, const PhiloxArgs& rng, int64_t* ids, const ErrorSink& errors,
                         void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const bool argmax = temperature == 0.f;
  const float inv_t = argmax ? 1.f : 1.f / temperature;
  if (!use_fast_path(vocab, temperature, top_k)) {
    rlkernel_sample_rows<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
        logits, row_stride, vocab, inv_t, argmax, top_k, top_p, rng, ids, errors);
    return nullptr;
  }
  const int64_t splits = splits_for(vocab);
  if (workspace_bytes < sample_workspace_bytes(rows, vocab, temperature, top_k)) return "sample workspace too small";
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (device >= kMaxDevices) return "device index beyond the sampler's per-device table";
  const FastPathDevice& dev = fast_path_device<T>(device);
  if (dev.err != cudaSuccess) return cudaGetErrorString(dev.err);
  auto* cand = static_cast<uint64_t*>(workspace);
  auto* counts = reinterpret_cast<uint32_t*>(cand + rows * splits * kCandCap);
  const int64_t chunks = rows * splits;
  const unsigned grid = static_cast<unsigned>(chunks < dev.candidate_blocks ? chunks : dev.candidate_blocks);
  rlkernel_sample_candidates<T><<<grid, kCandThreads, kStages * kStageBytes<T>, stream>>>(
      logits, row_stride, vocab, static_cast<int>(splits), static_cast<int>(chunks), inv_t,
      argmax ? 1 : static_cast<int>(top_k), cand, counts);
  // Programmatic dependent launch on Hopper and later: the select grid is scheduled while the candidates grid
  // drains and waits for its results in cudaGridDependencySynchronize, hiding the gap between the two kernels.
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(rows));
  cfg.blockDim = dim3(kRowThreads);
  cfg.stream = stream;
  cfg.attrs = &pdl;
  cfg.numAttrs = dev.major >= 9 ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, rlkernel_sample_select<T>, logits, row_stride, vocab, static_cast<int>(splits), inv_t,
                           static_cast<const uint64_t*>(cand), static_cast<const uint32_t*>(counts), argmax, top_k,
                           top_p, rng, ids, errors);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  return nullptr;
}

}  // namespace

size_t sample_workspace_bytes(int64_t rows, int64_t vocab, float temperature, int64_t top_k) {
  if (!use_fast_path(vocab, temperature, top_k)) return 0;
  const int64_t slots = rows * splits_for(vocab);
  return static_cast<size_t>(slots) * (kCandCap * sizeof(uint64_t) + sizeof(uint32_t));
}

const char* sample_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                          float temperature, int64_t top_k, double top_p, const PhiloxArgs& rng, int64_t* ids,
                          const ErrorSink& errors, void* workspace, size_t workspace_bytes, void* stream) {
  if (rows <= 0) return nullptr;
  if (vocab <= 0 || vocab >= (int64_t{1} << 31)) return "vocab size must be in [1, 2^31)";
  if (rows >= (int64_t{1} << 31) || rows * splits_for(vocab) >= (int64_t{1} << 31)) return "too many rows";
  if (!(temperature >= 0.f) || top_k < 0 || !(top_p > 0.0 && top_p <= 1.0)) return "bad sampling parameters";
  nvtx3::scoped_range_in<NvtxDomain> range{
      nvtx3::event_attributes{nvtx3::registered_string_in<NvtxDomain>::get<SampleMessage>()}};
  auto st = static_cast<cudaStream_t>(stream);
  const char* msg = nullptr;
  switch (dtype) {
    case ElemType::kFloat32:
      msg = launch_typed(static_cast<const float*>(logits), rows, vocab, row_stride, temperature, top_k, top_p, rng,
                         ids, errors, workspace, workspace_bytes, st);
      break;
    case ElemType::kFloat16:
      msg = launch_typed(static_cast<const __half*>(logits), rows, vocab, row_stride, temperature, top_k, top_p,
                         rng, ids, errors, workspace, workspace_bytes, st);
      break;
    case ElemType::kBFloat16:
      msg = launch_typed(static_cast<const __nv_bfloat16*>(logits), rows, vocab, row_stride, temperature, top_k,
                         top_p, rng, ids, errors, workspace, workspace_bytes, st);
      break;
    default:
      return "logits dtype unsupported (float16/bfloat16/float32)";
  }
  if (msg != nullptr) return msg;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace rlkernel
