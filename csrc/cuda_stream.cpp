// The one source that needs torch's CUDA headers: the current stream of a device. Built only where torch has
// CUDA (setup.py); the CI compile gate skips it where the installed torch wheel lacks these headers.
#include <c10/cuda/CUDAStream.h>

#include "rlkernel/common_api.h"

namespace rlkernel {

void* current_cuda_stream(int device_index) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream());
}

}  // namespace rlkernel
