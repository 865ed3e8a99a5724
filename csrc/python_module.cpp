// The Python module rlkernel._C: importing it loads this library, whose static registration blocks (the library in
// csrc/library.cpp, each op's fragment in its own file) register torch.ops.rlkernel.*. Beside them, eager entries
// that skip torch's op dispatcher (schema parsing, the boxed call): rlkernel's no-grad eager path calls these,
// torch.compile and autograd the registered ops; both run the same C++ (csrc/torch_ops.h), so the results are the
// same bits. About 20 us of a small call was torch's custom-op call path (docs/benchmarks.md, issue 17).
// BUILT_ARCHS: the sm_XX targets setup.py compiled for (comma-separated at build time).
#include <torch/extension.h>

#include <algorithm>
#include <string>

#include "torch_ops.h"

#ifndef RLKERNEL_BUILT_ARCHS
#define RLKERNEL_BUILT_ARCHS ""
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "rlkernel CUDA kernels (torch.ops.rlkernel) and their eager entries";
  pybind11::list archs;
  const std::string built = RLKERNEL_BUILT_ARCHS;
  for (size_t start = 0; start < built.size();) {
    const size_t end = std::min(built.find(',', start), built.size());
    archs.append(built.substr(start, end - start));
    start = end + 1;
  }
  m.attr("BUILT_ARCHS") = pybind11::tuple(archs);
  m.def("logp_forward_eager", &rlkernel::ops::logp_forward_eager,
        "torch.ops.rlkernel.logp_forward(logits, ids, temperature, ignore_index, compute_entropy, error_record, "
        "error_seq, error_op) without torch's dispatcher: no autograd, no torch.compile");
  m.def("sample_eager", &rlkernel::ops::sample,
        "torch.ops.rlkernel.sample(...) with every argument given, without torch's dispatcher");
  m.def("sample_processed_eager", &rlkernel::ops::sample_processed,
        "torch.ops.rlkernel.sample_processed(...) with every argument given, without torch's dispatcher");
}
