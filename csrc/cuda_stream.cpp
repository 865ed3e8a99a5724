// The one source that needs torch's CUDA headers: the current stream of a device. Built only where torch has
// CUDA (setup.py); the CI compile gate skips it because the CPU wheel lacks these headers. It also holds the
// Python module init of rlkernel._C, which exists only in such builds.
#include <Python.h>
#include <c10/cuda/CUDAStream.h>

#include "rlkernel/logp_api.h"

#ifndef RLKERNEL_BUILT_ARCHS
#define RLKERNEL_BUILT_ARCHS ""
#endif

namespace rlkernel {

void* current_cuda_stream(int device_index) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream());
}

}  // namespace rlkernel

// Importing rlkernel._C loads this library, whose static TORCH_LIBRARY blocks register torch.ops.rlkernel.*.
// BUILT_ARCHS: the sm_XX targets setup.py compiled for (comma-separated at build time).
static PyModuleDef rlkernel_module = {PyModuleDef_HEAD_INIT, "_C", "rlkernel CUDA kernels (torch.ops.rlkernel)", -1,
                                      nullptr, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&rlkernel_module);
  if (m == nullptr) return nullptr;
  PyObject* text = PyUnicode_FromString(RLKERNEL_BUILT_ARCHS);
  PyObject* sep = PyUnicode_FromString(",");
  PyObject* archs = nullptr;
  if (text != nullptr && sep != nullptr) {
    archs = PyUnicode_GetLength(text) == 0 ? PyList_New(0) : PyUnicode_Split(text, sep, -1);
  }
  Py_XDECREF(text);
  Py_XDECREF(sep);
  PyObject* tuple = archs == nullptr ? nullptr : PyList_AsTuple(archs);
  Py_XDECREF(archs);
  if (tuple == nullptr || PyModule_AddObject(m, "BUILT_ARCHS", tuple) < 0) {
    Py_XDECREF(tuple);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
