// Small CUDA + NVTX library the fixture programs (tools/traces/*.py) load through ctypes.
// Why C and not the `nvtx` Python package alone: the fixtures must exercise NVTX forms the
// analyzer meets in other programs' traces -- inline ASCII messages vs registered strings,
// the default domain vs named domains, start/end ranges ended on another thread -- and CUB's
// own `CCCL:` ranges, which only a CUB call compiled with NVTX3 available emits.
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <cub/device/device_scan.cuh>
#include <nvtx3/nvToolsExt.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "tricky_lib: %s failed: %s\n", #x, cudaGetErrorString(e_)); return (int)e_; } } while (0)

// A templated name on purpose: demangled kernel names carry `<>`, `,` and `&`-free text the
// HTML report must escape; the `rlkernel_` prefix is what fused patterns match.
template <typename T, int kUnroll>
__global__ void rlkernel_demo_fwd(T* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * T(0.5) + T(kUnroll);
}

// Burns a fixed number of clock cycles, so a kernel launched inside a short range is still
// running long after the range closed (GPU projection must follow it).
__global__ void spin_kernel(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}

__global__ void tiny_kernel(int* p) { if (p) p[threadIdx.x] += 1; }

extern "C" {

int64_t tl_domain(const char* name) { return (int64_t)(uintptr_t)nvtxDomainCreateA(name); }

int64_t tl_register(int64_t dom, const char* s) {
  return (int64_t)(uintptr_t)nvtxDomainRegisterStringA((nvtxDomainHandle_t)(uintptr_t)dom, s);
}

static nvtxEventAttributes_t attrs_ascii(const char* s) {
  nvtxEventAttributes_t a = {};
  a.version = NVTX_VERSION; a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII; a.message.ascii = s;
  return a;
}

static nvtxEventAttributes_t attrs_registered(int64_t sid) {
  nvtxEventAttributes_t a = {};
  a.version = NVTX_VERSION; a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
  a.message.registered = (nvtxStringHandle_t)(uintptr_t)sid;
  return a;
}

// dom == 0: the default domain (nvtxRangePushA, inline text).
void tl_push_inline(int64_t dom, const char* s) {
  if (dom == 0) { nvtxRangePushA(s); return; }
  nvtxEventAttributes_t a = attrs_ascii(s);
  nvtxDomainRangePushEx((nvtxDomainHandle_t)(uintptr_t)dom, &a);
}

void tl_push_registered(int64_t dom, int64_t sid) {
  nvtxEventAttributes_t a = attrs_registered(sid);
  nvtxDomainRangePushEx((nvtxDomainHandle_t)(uintptr_t)dom, &a);
}

void tl_pop(int64_t dom) {
  if (dom == 0) nvtxRangePop(); else nvtxDomainRangePop((nvtxDomainHandle_t)(uintptr_t)dom);
}

uint64_t tl_start(int64_t dom, const char* s) {
  if (dom == 0) return nvtxRangeStartA(s);
  nvtxEventAttributes_t a = attrs_ascii(s);
  return nvtxDomainRangeStartEx((nvtxDomainHandle_t)(uintptr_t)dom, &a);
}

void tl_end(int64_t dom, uint64_t id) {
  if (dom == 0) nvtxRangeEnd(id); else nvtxDomainRangeEnd((nvtxDomainHandle_t)(uintptr_t)dom, id);
}

int tl_fused(float* x, int n, void* stream) {
  rlkernel_demo_fwd<float, 4><<<(n + 255) / 256, 256, 0, (cudaStream_t)stream>>>(x, n);
  CHECK(cudaGetLastError());
  return 0;
}

int tl_spin(long long cycles, void* stream) {
  spin_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(cycles);
  CHECK(cudaGetLastError());
  return 0;
}

int tl_memset(void* p, int value, size_t bytes, void* stream) {
  CHECK(cudaMemsetAsync(p, value, bytes, (cudaStream_t)stream));
  return 0;
}

// The blocking forms NVIDIA's expert rules flag (cuda_memset_sync, cuda_memcpy_sync): plain cudaMemset
// and cudaMemcpy, on the legacy default stream.
int tl_memset_sync(void* p, int value, size_t bytes) {
  CHECK(cudaMemset(p, value, bytes));
  return 0;
}

int tl_memcpy_sync(void* dst, const void* src, size_t bytes, int kind) {
  CHECK(cudaMemcpy(dst, src, bytes, (cudaMemcpyKind)kind));
  return 0;
}

// An inclusive scan through CUB: CUB opens its own `CCCL:cub::DeviceScan::InclusiveSum` range
// (registered string, domain CCCL) around the launches; called twice (size query + run).
int tl_cub_scan(const int* in, int* out, int n, void* stream) {
  cudaStream_t s = (cudaStream_t)stream;
  size_t bytes = 0;
  CHECK(cub::DeviceScan::InclusiveSum(nullptr, bytes, in, out, n, s));
  void* tmp = nullptr;
  CHECK(cudaMallocAsync(&tmp, bytes, s));
  CHECK(cub::DeviceScan::InclusiveSum(tmp, bytes, in, out, n, s));
  CHECK(cudaFreeAsync(tmp, s));
  return 0;
}

// n launches, each inside its own push/pop range of the given domain and registered string:
// the scale benchmark's shape (one range per launch, a million of them).
int tl_many(long long n, int64_t dom, int64_t sid) {
  int* p = nullptr;
  CHECK(cudaMalloc(&p, 32 * sizeof(int)));
  nvtxEventAttributes_t a = attrs_registered(sid);
  for (long long i = 0; i < n; ++i) {
    nvtxDomainRangePushEx((nvtxDomainHandle_t)(uintptr_t)dom, &a);
    tiny_kernel<<<1, 32>>>(p);
    nvtxDomainRangePop((nvtxDomainHandle_t)(uintptr_t)dom);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFree(p));
  return 0;
}

}  // extern "C"
