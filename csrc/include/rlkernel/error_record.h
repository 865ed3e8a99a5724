// The per-device error record the fused kernels report bad input into, without a host sync
// (docs/contracts.md, section 1). Plain C++ for the host; the device-side writer is error_record.cuh.
//
// The record is 4 int64 in device memory, allocated and read by rlkernel/errors.py (one per device, shared by
// every thread and stream of the process): {key, op, value, lock}. key = (call sequence number << 32) | flat
// position, kErrorRecordEmpty when clear; the lowest key wins, so the record holds the first error of the earliest
// call. op says what kind of error (kErrOp*), value the offending token id (bad ids) or argument code (bad arguments). lock is 0 between writers.
#pragma once

#include <cstdint>

namespace rlkernel {

constexpr int64_t kErrorRecordEmpty = INT64_MAX;

// The op codes of rlkernel/errors.py (ERR_*): which check the position failed.
constexpr int kErrOpLogpBadId = 1;       // logp: a token id outside [0, V) that is not ignore_index
constexpr int kErrOpSampleNoDist = 2;    // sample: a row without a distribution
// sample / processed logp: a per-row setting out of range, checked on the device (value: the argument's code,
// kArg* in sampling_api.h; position: the row). Kernels write it through a copy of their sink with this op.
constexpr int kErrOpBadArg = 3;

// Where one call reports: record == nullptr reports nothing (RLKERNEL_VALIDATE=0).
struct ErrorSink {
  int64_t* record = nullptr;
  int64_t seq = 0;  // the call's sequence number, < 2^31
  int op = 0;
};

// The sink of one op call from its integer arguments: the record's device address (0: report nothing), the call's
// sequence number and the error kind; checks their ranges (defined in csrc/library.cpp, used by every op file).
ErrorSink error_sink(int64_t record, int64_t seq, int64_t op);

}  // namespace rlkernel
