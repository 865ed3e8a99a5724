// The whole-row path's candidate list, for rows with 1 <= top_k <= kMaxRowCandK (top_k larger than the fast
// path's kMaxFastK: rlkernel_sample_rows). Instead of running the exact law's ~10 visits of the row from global
// memory (each radix pass, the mass passes and the final pass read all V tokens again), the block reads the row
// twice and runs the same law on a few thousand candidates in shared memory:
//   1. each thread keeps the kRowTop largest keys of its tokens; L = the k-th largest of those
//      kRowThreads * kRowTop keys. A subset's k-th largest is at most the row's, so every token whose key is at
//      least the row's k-th largest (ties included) has key >= L;
//   2. the tokens with key >= L are appended (key, id) to shared memory (about k + the ties at L: 1.04-1.07 k on
//      Gaussian rows of 128256 tokens);
//   3. filter_and_draw runs on them. Every stage of the law is a function of the set, not of the order it is
//      visited in (integer counts and fixed-point masses, a race broken by id), and the top-k set and everything
//      the later stages keep lie inside the candidates: the same kept set, the same masses, the same draw, bit for
//      bit, as on the whole row.
// A row with more than kRowCandCap candidates (many ties at L, or fewer than k tokens above -inf) runs the law on
// the whole row, as before.
#pragma once

#include "rlkernel/row_reduce.cuh"  // RawVec, raw_elem
#include "rlkernel/sampling_filter.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kMaxRowCandK = 1024;
constexpr int kRowTop = 4;         // keys a thread keeps in step 1
constexpr int kRowCandCap = 2048;  // candidates shared memory holds (16 KiB)
constexpr int kRowCandThreads = 512;  // = kRowThreads (static_assert in sampling_kernels.cuh)
static_assert(kRowCandThreads * kRowTop >= kMaxRowCandK, "step 1 must keep at least k keys");
static_assert(kRowCandCap >= kMaxRowCandK, "room for the top-k itself");

struct RowCandSmem {
  union {
    uint32_t top[kRowCandThreads * kRowTop];  // step 1's keys
    uint64_t cand[kRowCandCap];               // step 2's (key << 32) | id, after step 1's keys are read
  };
  uint32_t n;
};

// Every token of a row as (key, id), the key by RowSource's expression, 16-byte vectors where the row is aligned
// (its tail, and an unaligned row, element by element). Order: not RowSource's, and no caller depends on it.
template <typename T, int NT, class F>
__device__ __forceinline__ void visit_row_vectors(const T* p, int64_t vocab, float inv_t, F&& f) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  int64_t tail = 0;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    const int64_t nvec = vocab / kVec;
    for (int64_t j = threadIdx.x; j < nvec; j += NT) {
      RawVec v;
      v.u4 = __ldg(reinterpret_cast<const uint4*>(p) + j);
#pragma unroll
      for (int e = 0; e < kVec; ++e) f(float_key(scaled(raw_elem<T>(v, e), inv_t)), j * kVec + e);
    }
    tail = nvec * kVec;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += NT) f(float_key(scaled(to_float(__ldg(p + i)), inv_t)), i);
}

// Elements kept in an array (step 1's keys; their ids are unused)
struct KeyArraySource {
  const uint32_t* key;
  int n;
  template <class F>
  __device__ __forceinline__ void visit(F&& f) const {
    for (int i = threadIdx.x; i < n; i += kRowCandThreads) f(key[i], int64_t{i});
  }
};

// The candidates, as filter_and_draw's element source; scaled_at reads the row itself (RowSource's expression).
template <typename T>
struct CandidateSource {
  const uint64_t* cand;
  int n;
  const T* p;
  float inv_t;
  template <class F>
  __device__ __forceinline__ void visit(F&& f) const {
    for (int i = threadIdx.x; i < n; i += kRowCandThreads) {
      const uint64_t c = cand[i];
      f(static_cast<uint32_t>(c >> 32), static_cast<int64_t>(static_cast<uint32_t>(c)));
    }
  }
  __device__ __forceinline__ float scaled_at(int64_t i) const { return scaled(to_float(__ldg(p + i)), inv_t); }
};

// Steps 1 and 2 on one row (every thread of the block calls it; k in [1, kMaxRowCandK], k < vocab). Returns the
// candidate count to every thread, or -1 when they overflow kRowCandCap.
template <typename T>
__device__ int row_candidates(const T* p, int64_t vocab, float inv_t, int64_t k, RowCandSmem& cs, RadixSmem& sm) {
  uint32_t t0 = kNoKey, t1 = kNoKey, t2 = kNoKey, t3 = kNoKey;  // descending
  static_assert(kRowTop == 4, "four registers");
  visit_row_vectors<T, kRowCandThreads>(p, vocab, inv_t, [&](uint32_t key, int64_t) {
    if (key > t3) {  // insert: t3 = key, then one bubble pass up
      t3 = key;
      uint32_t hi = max(t2, t3);
      t3 = min(t2, t3);
      t2 = hi;
      hi = max(t1, t2);
      t2 = min(t1, t2);
      t1 = hi;
      hi = max(t0, t1);
      t1 = min(t0, t1);
      t0 = hi;
    }
  });
  uint32_t* top = cs.top + threadIdx.x * kRowTop;
  top[0] = t0;
  top[1] = t1;
  top[2] = t2;
  top[3] = t3;
  if (threadIdx.x == 0) cs.n = 0;
  __syncthreads();
  auto all = [](uint32_t, int64_t) { return true; };
  auto by_key = [](uint32_t key, int64_t) { return key; };
  // (radix_select's last barrier comes after its last read of cs.top: step 2 may overwrite it)
  const uint32_t bound =
      radix_select<kRowCandThreads, false>(KeyArraySource{cs.top, kRowCandThreads * kRowTop}, all, by_key, 32,
                                           static_cast<uint64_t>(k), 0.f, sm)
          .value;
  // fewer than k tokens above -inf (a masked row): every token would be a candidate, one shared atomic each, to
  // overflow the list in the end; the whole row at once instead (the same result: a count of V > kRowCandCap)
  if (bound <= float_key(-INFINITY) && vocab > kRowCandCap) return -1;
  visit_row_vectors<T, kRowCandThreads>(p, vocab, inv_t, [&](uint32_t key, int64_t id) {
    if (key < bound) return;
    const uint32_t slot = atomicAdd(&cs.n, 1u);
    if (slot < kRowCandCap) cs.cand[slot] = (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(id);
  });
  __syncthreads();
  const uint32_t n = cs.n;
  return n > static_cast<uint32_t>(kRowCandCap) ? -1 : static_cast<int>(n);
}

struct RowLawSmem {
  RadixSmem radix;
  RowCandSmem cand;
};

// The exact law on one row that no candidates kernel has filtered (sample_rows, and select's whole-row rows): on
// its candidate list when it is a top-k row with k <= kMaxRowCandK and the list fits, else on the whole row.
// Every thread of the block calls it; filter_and_draw's kMode.
template <int kMode, typename T>
__device__ __forceinline__ KeptStats row_law(const T* row_ptr, int64_t vocab, const RowSettings& rset,
                                             const FilterArgs& args, RowLawSmem& sm) {
  const int n = !rset.argmax && rset.top_k >= 1 && rset.top_k <= kMaxRowCandK
                    ? row_candidates(row_ptr, vocab, rset.inv_t, rset.top_k, sm.cand, sm.radix)
                    : -1;
  if (n >= 0) {
    return filter_and_draw<kRowCandThreads, kMode>(CandidateSource<T>{sm.cand.cand, n, row_ptr, rset.inv_t}, args,
                                                    sm.radix);
  }
  return filter_and_draw<kRowCandThreads, kMode>(RowSource<T, kRowCandThreads>{row_ptr, vocab, rset.inv_t}, args,
                                                  sm.radix);
}

}  // namespace sampling
}  // namespace rlkernel
