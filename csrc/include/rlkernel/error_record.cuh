// Device side of the error record (error_record.h): a kernel thread that finds bad input calls report_error.
// Errors are rare (bad input), so a spin lock serialises the few writers; the common path reads nothing.
#pragma once

#include "rlkernel/error_record.h"

namespace rlkernel {

// Keeps (key, op, value) if key is below the record's: the first error of the earliest call survives. Positions
// are taken modulo 2^32 (rows and ids are < 2^31 in every kernel here).
__device__ __forceinline__ void report_error(const ErrorSink& sink, long long position, long long value) {
  if (sink.record == nullptr) return;
  const long long key = (static_cast<long long>(sink.seq) << 32) | (position & 0xFFFFFFFFLL);
  auto* rec = reinterpret_cast<long long*>(sink.record);
  volatile long long* vrec = rec;
  if (vrec[0] <= key) return;  // an earlier error is already kept (re-checked under the lock)
  auto* lock = reinterpret_cast<unsigned long long*>(rec + 3);
  // Volta and later schedule the threads of a warp independently, so a lane spinning here cannot starve the
  // lane that holds the lock.
  while (atomicCAS(lock, 0ull, 1ull) != 0ull) {
  }
  __threadfence();
  if (key < vrec[0]) {
    vrec[1] = sink.op;
    vrec[2] = value;
    vrec[0] = key;
  }
  __threadfence();
  atomicExch(lock, 0ull);
}

}  // namespace rlkernel
