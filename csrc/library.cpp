// The op library torch.ops.rlkernel: defined here, once (torch allows one TORCH_LIBRARY per namespace). Each op's
// file adds its schemas and CUDA impls as a fragment (TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL: logp_op.cpp,
// sampling_op.cpp, linear_logp_op.cpp), in whatever order the static initialisers run. Beside it,
// error_sink: the checked error-record argument every op file passes to its launchers.
// Only torch/library.h-level headers (the CI compile gate builds this file with the CPU torch wheel).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>

#include "rlkernel/error_record.h"

namespace rlkernel {

ErrorSink error_sink(int64_t record, int64_t seq, int64_t op) {
  TORCH_CHECK(record >= 0, "rlkernel: bad error record address");
  TORCH_CHECK(seq >= 0 && seq < (int64_t{1} << 31), "rlkernel: error sequence number out of range");
  TORCH_CHECK(op == kErrOpLogpBadId || op == kErrOpSampleNoDist || op == kErrOpBadArg, "rlkernel: unknown error kind ", op);
  ErrorSink sink;
  sink.record = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(record));
  sink.seq = seq;
  sink.op = static_cast<int>(op);
  return sink;
}

}  // namespace rlkernel

// No schema here: each op is defined in its own file's fragment. This block claims the namespace, so that a second
// TORCH_LIBRARY(rlkernel), in this library or another one loaded into the process, fails at load.
TORCH_LIBRARY(rlkernel, m) {
  (void)m;
}
