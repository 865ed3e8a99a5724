// Launchers of the fused sampler (with or without its processed log-probs, from the same kernels in one pass) and of
// the processed log-probs (the same kernels in stats mode). No torch include (the CI compile gate builds this with
// nvcc alone). Each opens its NVTX op range (rlkernel:op.sample, op.logp.forward, op.logp.backward) around
// everything it puts on the stream: the rlkernel_* kernels, nothing else (bad rows go to the device's error record
// from inside them).
#include <cuda_runtime.h>
#include <nvtx3/nvtx3.hpp>

#include <mutex>

#include "rlkernel/sampling_api.h"
#include "rlkernel/sampling_kernels.cuh"
#include "rlkernel/sampling_processed.cuh"

namespace rlkernel {
namespace {

using namespace sampling;

struct NvtxDomain {
  static constexpr char const* name{"rlkernel"};
};
struct SampleMessage {
  static constexpr char const* message{"op.sample"};
};

struct LogpFwdMessage {
  static constexpr char const* message{"op.logp.forward"};
};
struct LogpBwdMessage {
  static constexpr char const* message{"op.logp.backward"};
};

template <class Message>
nvtx3::scoped_range_in<NvtxDomain> op_range() {
  return nvtx3::scoped_range_in<NvtxDomain>{
      nvtx3::event_attributes{nvtx3::registered_string_in<NvtxDomain>::get<Message>()}};
}

int64_t splits_for(int64_t vocab) { return (vocab + kChunk - 1) / kChunk; }

// The candidate path: when some row may take it, as far as the host knows without reading per-row values (a
// per-row top_k, a small scalar k, or every row at T = 0), and at most one chunk per thread of the select block.
// Rows that turn out not to (their own k is 0, large or >= V) take the whole-row path inside select.
bool use_fast_path(int64_t vocab, const SampleSettings& s) {
  const bool all_argmax = s.temperature_rows == nullptr && s.temperature == 0.f;
  const bool small_k = s.top_k_rows != nullptr || all_argmax ||
                       (s.top_k >= 1 && s.top_k <= kMaxFastK && s.top_k < vocab);
  return small_k && splits_for(vocab) <= kRowThreads;
}

SampleSettings scalar_settings(float temperature, int64_t top_k, double top_p, const PhiloxArgs& rng) {
  SampleSettings s;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.generator = rng;
  return s;
}

// What the fast path's launches need to know about a device, found once per device and candidates kernel (element
// type, and whether it stores the raw log-probs' chunk states): its dynamic shared memory opt-in, its resident blocks
// (the persistent grid), and whether programmatic dependent launch exists (compute capability 9+).
struct FastPathDevice {
  cudaError_t err = cudaSuccess;
  int major = 0;
  int candidate_blocks = 0;  // resident candidates blocks on the whole device
};
constexpr int kMaxDevices = 64;

template <typename T, bool kLse = false>  // (the default: the plain draw's, as tools/sampler_timeline/driver.cu asks)
const FastPathDevice& fast_path_device(int device) {
  static std::once_flag once[kMaxDevices];
  static FastPathDevice info[kMaxDevices];
  std::call_once(once[device], [device] {
    FastPathDevice& d = info[device];
    constexpr int smem = static_cast<int>(kStages * kStageBytes<T>);
    int sms = 0, per_sm = 0;
    d.err = cudaFuncSetAttribute(rlkernel_sample_candidates<T, kLse>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem);
    if (d.err == cudaSuccess) d.err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (d.err == cudaSuccess) d.err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (d.err == cudaSuccess) {
      d.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rlkernel_sample_candidates<T, kLse>,
                                                            kCandThreads, smem);
    }
    d.candidate_blocks = per_sm * sms;
    if (d.err == cudaSuccess && d.candidate_blocks == 0) d.err = cudaErrorInvalidConfiguration;
  });
  return info[device];
}

// kDraw (ids), kDrawLogp / kDrawLogpRaw (ids and out.logp) or the processed log-prob forward (kStats: out), on the
// same kernels.
template <typename T, int kMode>
const char* launch_typed(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride, const SampleSettings& s,
                         int64_t* ids, const ProcessedOut& out, const ErrorSink& errors, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  if (!use_fast_path(vocab, s)) {
    if (s.top_k_rows != nullptr || (s.top_k >= 1 && s.top_k <= kMaxRowCandK)) {
      rlkernel_sample_rows<T, kMode, true><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
          logits, row_stride, vocab, s, ids, out, errors);
    } else {
      rlkernel_sample_rows<T, kMode, false><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
          logits, row_stride, vocab, s, ids, out, errors);
    }
    return nullptr;
  }
  constexpr bool kLse = kMode == kDrawLogpRaw;  // the candidates kernel also stores each chunk's softmax states
  const int64_t splits = splits_for(vocab);
  if (workspace_bytes < sample_rows_workspace_bytes(rows, vocab, s, kLse)) return "sample workspace too small";
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  if (device >= kMaxDevices) return "device index beyond the sampler's per-device table";
  const FastPathDevice& dev = fast_path_device<T, kLse>(device);
  if (dev.err != cudaSuccess) return cudaGetErrorString(dev.err);
  const int64_t chunks = rows * splits;
  // workspace: the candidates, the chunk states (kLse; 8-byte aligned after the candidates), the counts
  auto* cand = static_cast<uint64_t*>(workspace);
  auto* states = kLse ? reinterpret_cast<float2*>(cand + chunks * kCandCap) : nullptr;
  auto* counts = reinterpret_cast<uint32_t*>(cand + chunks * kCandCap) + (kLse ? 2 * chunks * kCandWarps : 0);
  const unsigned grid = static_cast<unsigned>(chunks < dev.candidate_blocks ? chunks : dev.candidate_blocks);
  rlkernel_sample_candidates<T, kLse><<<grid, kCandThreads, kStages * kStageBytes<T>, stream>>>(
      logits, row_stride, vocab, static_cast<int>(splits), static_cast<int>(chunks), s, cand, counts, states);
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
  err = cudaLaunchKernelEx(&cfg, rlkernel_sample_select<T, kMode>, logits, row_stride, vocab,
                           static_cast<int>(splits), static_cast<const uint64_t*>(cand),
                           static_cast<const uint32_t*>(counts), s, ids, out, errors,
                           static_cast<const float2*>(states));
  if (err != cudaSuccess) return cudaGetErrorString(err);
  return nullptr;
}

template <int kMode>
const char* launch_any(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                       const SampleSettings& s, int64_t* ids, const ProcessedOut& out, const ErrorSink& errors,
                       void* workspace, size_t workspace_bytes, cudaStream_t st) {
  switch (dtype) {
    case ElemType::kFloat32:
      return launch_typed<float, kMode>(static_cast<const float*>(logits), rows, vocab, row_stride, s, ids, out,
                                         errors, workspace, workspace_bytes, st);
    case ElemType::kFloat16:
      return launch_typed<__half, kMode>(static_cast<const __half*>(logits), rows, vocab, row_stride, s, ids, out,
                                          errors, workspace, workspace_bytes, st);
    case ElemType::kBFloat16:
      return launch_typed<__nv_bfloat16, kMode>(static_cast<const __nv_bfloat16*>(logits), rows, vocab,
                                                 row_stride, s, ids, out, errors, workspace, workspace_bytes, st);
  }
  return "logits dtype unsupported (float16/bfloat16/float32)";
}

const char* check_sizes(int64_t rows, int64_t vocab, const SampleSettings& s) {
  if (vocab <= 0 || vocab >= (int64_t{1} << 31)) return "vocab size must be in [1, 2^31)";
  if (rows >= (int64_t{1} << 31) || rows * splits_for(vocab) >= (int64_t{1} << 31)) return "too many rows";
  if (!(s.temperature >= 0.f) || s.top_k < 0 || !(s.top_p > 0.0 && s.top_p <= 1.0) ||
      !(s.min_p >= 0.f && s.min_p <= 1.f)) {
    return "bad sampling parameters";
  }
  return nullptr;
}

const char* last_error(const char* msg) {
  if (msg != nullptr) return msg;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab, const SampleSettings& s, bool raw_logp) {
  if (!use_fast_path(vocab, s)) return 0;
  const int64_t slots = rows * splits_for(vocab);
  const size_t states = raw_logp ? kCandWarps * sizeof(float2) : 0;  // the raw log-probs' chunk states
  return static_cast<size_t>(slots) * (kCandCap * sizeof(uint64_t) + states + sizeof(uint32_t));
}

size_t sample_workspace_bytes(int64_t rows, int64_t vocab, float temperature, int64_t top_k) {
  return sample_rows_workspace_bytes(rows, vocab, scalar_settings(temperature, top_k, 1.0, PhiloxArgs{}));
}

const char* sample_rows_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                               const SampleSettings& settings, int64_t* ids, float* logp, const ErrorSink& errors,
                               void* workspace, size_t workspace_bytes, void* stream, bool raw_logp) {
  if (rows <= 0) return nullptr;
  if (const char* msg = check_sizes(rows, vocab, settings)) return msg;
  auto range = op_range<SampleMessage>();
  ProcessedOut out;
  out.logp = logp;  // the draws_logp modes write the drawn ids' log-probs here; the other fields are stats mode's
  const auto st = static_cast<cudaStream_t>(stream);
  const char* msg = nullptr;
  if (logp == nullptr) {
    msg = launch_any<kDraw>(logits, dtype, rows, vocab, row_stride, settings, ids, out, errors, workspace,
                            workspace_bytes, st);
  } else if (raw_logp) {
    msg = launch_any<kDrawLogpRaw>(logits, dtype, rows, vocab, row_stride, settings, ids, out, errors, workspace,
                                   workspace_bytes, st);
  } else {
    msg = launch_any<kDrawLogp>(logits, dtype, rows, vocab, row_stride, settings, ids, out, errors, workspace,
                                workspace_bytes, st);
  }
  return last_error(msg);
}

const char* sample_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab, int64_t row_stride,
                          float temperature, int64_t top_k, double top_p, const PhiloxArgs& rng, int64_t* ids,
                          const ErrorSink& errors, void* workspace, size_t workspace_bytes, void* stream) {
  return sample_rows_launch(logits, dtype, rows, vocab, row_stride, scalar_settings(temperature, top_k, top_p, rng),
                            ids, nullptr, errors, workspace, workspace_bytes, stream);
}

const char* logp_processed_forward_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab,
                                          int64_t row_stride, const SampleSettings& settings,
                                          const ProcessedOut& out, const ErrorSink& errors, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  auto range = op_range<LogpFwdMessage>();
  if (rows <= 0) return nullptr;
  if (const char* msg = check_sizes(rows, vocab, settings)) return msg;
  SampleSettings s = settings;
  s.seeded = false;  // no noise: nothing reads it
  s.generator = PhiloxArgs{};
  return last_error(launch_any<kStats>(logits, dtype, rows, vocab, row_stride, s, nullptr, out, errors, workspace,
                                     workspace_bytes, static_cast<cudaStream_t>(stream)));
}

const char* logp_processed_backward_launch(const void* logits, ElemType dtype, int64_t rows, int64_t vocab,
                                           int64_t row_stride, const int64_t* ids, int64_t ignore_index,
                                           const float* stats, const int64_t* threshold, const float* grad_logp,
                                           int64_t grad_logp_stride, const float* grad_entropy,
                                           int64_t grad_entropy_stride, void* grad, int64_t grad_row_stride,
                                           void* stream) {
  auto range = op_range<LogpBwdMessage>();
  if (rows <= 0 || vocab <= 0) return nullptr;
  if (rows >= (int64_t{1} << 31)) return "too many rows";
  auto st = static_cast<cudaStream_t>(stream);
  const auto* st4 = reinterpret_cast<const float4*>(stats);
  const unsigned grid = static_cast<unsigned>(rows);
  switch (dtype) {
    case ElemType::kFloat32:
      rlkernel_logp_processed_bwd<float><<<grid, kBwdThreads, 0, st>>>(
          static_cast<const float*>(logits), row_stride, vocab, ids, ignore_index, st4, threshold, grad_logp,
          grad_logp_stride, grad_entropy, grad_entropy_stride, static_cast<float*>(grad), grad_row_stride);
      break;
    case ElemType::kFloat16:
      rlkernel_logp_processed_bwd<__half><<<grid, kBwdThreads, 0, st>>>(
          static_cast<const __half*>(logits), row_stride, vocab, ids, ignore_index, st4, threshold, grad_logp,
          grad_logp_stride, grad_entropy, grad_entropy_stride, static_cast<__half*>(grad), grad_row_stride);
      break;
    case ElemType::kBFloat16:
      rlkernel_logp_processed_bwd<__nv_bfloat16><<<grid, kBwdThreads, 0, st>>>(
          static_cast<const __nv_bfloat16*>(logits), row_stride, vocab, ids, ignore_index, st4, threshold,
          grad_logp, grad_logp_stride, grad_entropy, grad_entropy_stride, static_cast<__nv_bfloat16*>(grad),
          grad_row_stride);
      break;
    default:
      return "logits dtype unsupported (float16/bfloat16/float32)";
  }
  return last_error(nullptr);
}

}  // namespace rlkernel
