// The tiny extension tests/test_jit_build.py builds through rlkernel._jit (g++, no CUDA): the loader rlkernel._C's
// first-use build takes, with a source that compiles in a second (Python's C API only, no torch header).
// PROBE_TAG, a string given by a -D flag, is the module's TAG: it checks that such a flag reaches the compiler whole.
#include <Python.h>

#define RLK_CAT(a, b) a##b
#define RLK_INIT(name) RLK_CAT(PyInit_, name)
#define RLK_STR2(x) #x
#define RLK_STR(x) RLK_STR2(x)

#ifndef PROBE_TAG
#define PROBE_TAG "untagged"
#endif

static struct PyModuleDef probe_module = {PyModuleDef_HEAD_INIT, RLK_STR(TORCH_EXTENSION_NAME),
                                          "rlkernel._jit's test extension", -1, nullptr};

PyMODINIT_FUNC RLK_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&probe_module);
  if (m != nullptr && PyModule_AddStringConstant(m, "TAG", PROBE_TAG) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
