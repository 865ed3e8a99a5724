// The fused sampler's kernels.
//  fast path (1 <= top_k <= kMaxFastK, or T = 0):
//    rlkernel_sample_candidates: a persistent grid, each block walking a contiguous range of the rows' 8192-token
//      chunks, staging the next chunk in shared memory (cp.async) while it filters this one: it keeps every token
//      >= L, where at least k tokens of the row are >= L (so the row's k-th largest, and every token tied with
//      it, is >= L): L <= the k-th largest of the block's 256 per-thread maxima on a block's first chunk of a row,
//      then inherited by its next chunks of that row, and (fp32) raised from the threads' running maxima over
//      the row's chunks it has filtered.
//    rlkernel_sample_select: one block per row stages the candidates of all chunks in shared memory (a few
//      hundred: the row's top-k is among them, ties included), finds a key at or below the k-th with few
//      candidates above it and ranks those (top_by_threshold; with many ties at the k-th key, its warps sort runs
//      of 128 and merge them instead), and its first four warps run the exact law on the first k, one entry a
//      thread (finish_sorted). A row whose candidates overflow runs the law on the whole row.
//  general path (top_k = 0 or large): rlkernel_sample_rows runs the exact law on each whole row; with
//    top_k <= kMaxRowCandK on the row's candidate list (sampling_row_candidates.cuh: two reads of the row).
// Both paths keep the same set and race the same Philox noise per (row, id): they draw the same ids.
#pragma once

#include "rlkernel/row_reduce.cuh"  // max_nan
#include "rlkernel/sampling_filter.cuh"
#include "rlkernel/sampling_row_candidates.cuh"

namespace rlkernel {
namespace sampling {

constexpr int kCandThreads = 256;
constexpr int kTokensPerThread = 32;
constexpr int kChunk = kCandThreads * kTokensPerThread;  // 8192 tokens per chunk
constexpr int kBoundBits = 14;  // bits of L the candidates kernel decides below its maxima's common prefix
constexpr int kMaxFastK = 128;
constexpr int kCandCap = 4 * kMaxFastK;  // candidates one chunk may keep before its row overflows
constexpr int kRowThreads = 512;
// Candidates a select block stages (32 KiB, sharing shared memory with the whole-row path's histograms): a row
// with more (many ties at its k-th value) takes the whole-row path.
constexpr int kMaxSmemCand = 4096;
constexpr int kRun = 128;  // values one warp sorts (4 per lane)
static_assert(kMaxFastK <= kRun, "finish_sorted: the first k of one sorted run");
constexpr int kFinishWarps = kRun / 32;  // finish_sorted: one entry a thread
static_assert(kFinishWarps * 32 <= kRowThreads, "finish_sorted: enough threads for one entry each");
static_assert(kMaxSmemCand % kRun == 0, "whole runs");

// A chunk as each thread stages it: vector j of thread t (16 bytes: kVecTokens(T) tokens) covers tokens
// start + (j * kCandThreads + t) * kVecTokens ...: coalesced across the warp. A thread reads back only the
// vectors it copied itself, so its shared-memory slots need no block barrier.
template <typename T>
constexpr int kVecTokens = 16 / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kVecsPerThread = kTokensPerThread / kVecTokens<T>;
template <typename T>
constexpr int kVecStride = kCandThreads * kVecTokens<T>;  // tokens between a thread's vectors j and j + 1
template <typename T>
constexpr size_t kStageBytes = sizeof(T) * kChunk;
// Stages a candidates block cycles through: the chunk being filtered and the next kStages - 1 in flight (three
// measured slower, for every dtype: docs/kernel-notes.md, v12)
constexpr int kStages = 2;

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>  // wait until at most kPending of this thread's newest copy groups are in flight
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Chunk (row, split) of the rows x splits grid, stepped to the next chunk in row-major order without a division.
struct ChunkCursor {
  int row, split;
  __device__ __forceinline__ void next(int splits) {
    split += 1;
    if (split >= splits) {
      split -= splits;
      ++row;
    }
  }
};

template <typename T>
struct Chunk {
  const T* row_ptr;
  int64_t start;  // the chunk's first token
  bool aligned;   // the row starts on 16 bytes: its whole vectors can be staged
  bool regular;   // aligned and the whole chunk inside the row: no check per vector (all chunks but a row's last)
};

template <typename T>
__device__ __forceinline__ Chunk<T> chunk_at(const T* logits, int64_t row_stride, int64_t vocab, ChunkCursor cur) {
  const T* p = logits + static_cast<int64_t>(cur.row) * row_stride;
  const int64_t start = static_cast<int64_t>(cur.split) * kChunk;
  const bool aligned = reinterpret_cast<uintptr_t>(p) % 16 == 0;
  return Chunk<T>{p, start, aligned, aligned && start + kChunk <= vocab};
}

// Vector j of this thread: staged in shared memory (a whole vector of an aligned row) or read from global memory
// when the chunk is filtered.
template <typename T>
__device__ __forceinline__ bool vec_staged(const Chunk<T>& ch, int64_t vocab, int j) {
  return ch.aligned && ch.start + j * kVecStride<T> + static_cast<int>(threadIdx.x) * kVecTokens<T> +
                           kVecTokens<T> <= vocab;
}

// Starts the copy of this thread's vectors of `ch` into its slots at shared address `slots`.
template <typename T>
__device__ __forceinline__ void stage_chunk(const Chunk<T>& ch, int64_t vocab, uint32_t slots) {
  const T* src = ch.row_ptr + ch.start + static_cast<int>(threadIdx.x) * kVecTokens<T>;
  if (ch.regular) {  // the common case, straight-line: eight copies at fixed offsets
#pragma unroll
    for (int j = 0; j < kVecsPerThread<T>; ++j) cp_async16(slots + j * kCandThreads * 16, src + j * kVecStride<T>);
  } else {
#pragma unroll
    for (int j = 0; j < kVecsPerThread<T>; ++j) {
      if (vec_staged(ch, vocab, j)) cp_async16(slots + j * kCandThreads * 16, src + j * kVecStride<T>);
    }
  }
}

// max_nan (row_reduce.cuh, the log-prob kernels' own): NaN wins, so a NaN anywhere in a thread's tokens makes its
// maximum NaN
__device__ __forceinline__ float vec_max_nan(const uint4& v, const float*) {
  return max_nan(max_nan(__uint_as_float(v.x), __uint_as_float(v.y)),
                 max_nan(__uint_as_float(v.z), __uint_as_float(v.w)));
}
template <typename H2>  // __half2 / __nv_bfloat162: pairwise on the packed halves, one conversion at the end
__device__ __forceinline__ float vec_max_nan2(const uint4& v) {
  const H2* h = reinterpret_cast<const H2*>(&v);
  const H2 m = __hmax2_nan(__hmax2_nan(h[0], h[1]), __hmax2_nan(h[2], h[3]));
  return max_nan(to_float(m.x), to_float(m.y));
}
__device__ __forceinline__ float vec_max_nan(const uint4& v, const __half*) { return vec_max_nan2<__half2>(v); }
__device__ __forceinline__ float vec_max_nan(const uint4& v, const __nv_bfloat16*) {
  return vec_max_nan2<__nv_bfloat162>(v);
}

// The largest logit among this thread's tokens of the chunk (unscaled: 1/T > 0 keeps the order), NaN if any is
// NaN, -inf if they are all -inf (or none is in the row). mine: this thread's slots (generic shared pointer).
template <typename T, bool kRegular>
__device__ __forceinline__ float thread_max(const Chunk<T>& ch, int64_t vocab, const T* mine) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kVecsPerThread<T>; ++j) {
    if (kRegular || vec_staged(ch, vocab, j)) {
      m = max_nan(m, vec_max_nan(*reinterpret_cast<const uint4*>(mine + j * kVecStride<T>), mine));
    } else {
      const int64_t base = ch.start + j * kVecStride<T> + static_cast<int>(threadIdx.x) * kVecTokens<T>;
#pragma unroll
      for (int i = 0; i < kVecTokens<T>; ++i) {
        if (base + i < vocab) m = max_nan(m, to_float(__ldg(ch.row_ptr + base + i)));
      }
    }
  }
  return m;
}

// Bit e of the result: this thread's token e (vector e / kVecTokens, element e % kVecTokens) is in the row and
// its scaled logit is not below s_bound (NaN included: it must reach select, which marks the row bad). m: the
// largest of this thread's tokens, as thread_max finds it (read from the same registers).
template <typename T, bool kRegular>
__device__ __forceinline__ uint32_t kept_mask(const Chunk<T>& ch, int64_t vocab, float inv_t, float s_bound,
                                              const T* mine, float& m) {
  uint32_t mask = 0;
  m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kVecsPerThread<T>; ++j) {
    if (kRegular || vec_staged(ch, vocab, j)) {
      const uint4 v = *reinterpret_cast<const uint4*>(mine + j * kVecStride<T>);
      m = max_nan(m, vec_max_nan(v, mine));
      const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int i = 0; i < kVecTokens<T>; ++i) {
        if (!(scaled(to_float(x[i]), inv_t) < s_bound)) mask |= 1u << (j * kVecTokens<T> + i);
      }
    } else {
      const int64_t base = ch.start + j * kVecStride<T> + static_cast<int>(threadIdx.x) * kVecTokens<T>;
#pragma unroll
      for (int i = 0; i < kVecTokens<T>; ++i) {
        if (base + i >= vocab) continue;
        const float x = to_float(__ldg(ch.row_ptr + base + i));
        m = max_nan(m, x);
        if (!(scaled(x, inv_t) < s_bound)) mask |= 1u << (j * kVecTokens<T> + i);
      }
    }
  }
  return mask;
}

struct CandidateSmem {
  uint32_t maxima[kCandThreads];
  uint32_t bound;
  uint32_t next_bound;  // warp 0's search of the published running maxima (filter_chunk)
  // slots handed out in chunk i come from n_cand[i % 3]: thread 0 clears the next chunk's counter while this chunk
  // runs, after at least one chunk's end barrier since every thread last read it (in chunk i - 2), so a chunk
  // needs no barrier of its own before its first atomic
  uint32_t n_cand[3];
};

// Warp 0, after the block's per-thread maxima are in sm.maxima: L, the largest value with at least k maxima >= L,
// found bit by bit from the top (each bit kept while that still holds; 0 when fewer than k threads hold tokens).
// Every maximum shares the bits above the highest bit where they differ (OR ^ AND), so the search starts below
// it and stops after kBoundBits bits, the rest left 0: L may end a little lower (a few more candidates, never a
// lost one). One warp counts with a warp reduction per bit while the others wait at one barrier, instead of a
// block barrier per bit.
__device__ __forceinline__ uint32_t warp_bound(const uint32_t* maxima, int k) {
  const int lane = threadIdx.x % 32;
  constexpr int kPerLane = kCandThreads / 32;
  uint32_t m[kPerLane], any = 0, all = ~0u;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    m[r] = maxima[r * 32 + lane];
    any |= m[r];
    all &= m[r];
  }
  any = __reduce_or_sync(kFullMask, any);
  all = __reduce_and_sync(kFullMask, all);
  const uint32_t differ = any ^ all;
  const int high = differ ? 31 - __clz(static_cast<int>(differ)) : -1;
  uint32_t bound = high < 0 ? any : any & ~((2u << high) - 1u);  // the common prefix: all maxima are >= it
  for (int b = high; b >= 0 && b > high - kBoundBits; --b) {
    const uint32_t cb = bound | (1u << b);
    uint32_t n = 0;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) n += m[r] >= cb;
    if (static_cast<int>(__reduce_add_sync(kFullMask, n)) >= k) bound = cb;
  }
  return bound;
}

// The chunk's own bound: its per-thread maxima, then warp_bound (two block barriers; thread 0 clears
// *n_cand between them, after every thread's last read of it).
template <typename T, bool kRegular>
__device__ __forceinline__ uint32_t chunk_bound(const Chunk<T>& ch, int64_t vocab, float inv_t, int k,
                                                const T* mine, uint32_t* n_cand, CandidateSmem& sm) {
  const bool has_real = ch.start + static_cast<int>(threadIdx.x) * kVecTokens<T> < vocab;
  sm.maxima[threadIdx.x] = has_real ? float_key(scaled(thread_max<T, kRegular>(ch, vocab, mine), inv_t)) : kNoKey;
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) *n_cand = 0;
    const uint32_t l = warp_bound(sm.maxima, k);
    if (threadIdx.x == 0) sm.bound = l;
  }
  __syncthreads();
  return sm.bound;
}

// Every token of the chunk at or above the bound L written to out (its slot from the shared counter *n_cand).
// The tokens kept are those whose scaled logit s is not below L's float (every s with key(s) >= L, and a few
// -0.0 more when L is +0.0's key). L at or below -inf's key keeps the whole chunk (its row then overflows and
// takes the whole-row path); at or above +inf's key only +inf and NaN tokens reach it.
// Returns the key of this thread's largest token of the chunk (kNoKey if it holds none); raw_max: that token's
// logit, unscaled (thread_max's value; -inf if none).
template <typename T, bool kRegular>
__device__ __forceinline__ uint32_t emit_kept(const Chunk<T>& ch, int64_t vocab, float inv_t, uint32_t bound,
                                              const T* mine, uint64_t* out, uint32_t* n_cand, float& raw_max) {
  const float s_bound = bound <= float_key(-INFINITY) ? -INFINITY
                        : bound >= float_key(INFINITY) ? INFINITY
                                                       : key_float(bound);
  float m;
  uint32_t mask = kept_mask<T, kRegular>(ch, vocab, inv_t, s_bound, mine, m);
  raw_max = m;
  const bool has_real = ch.start + static_cast<int>(threadIdx.x) * kVecTokens<T> < vocab;
  // the shared counter hands out slots; select sorts the candidates by their (unique) packed value, so the order
  // they land in changes nothing downstream
  const uint32_t n_mine = __popc(mask);
  uint32_t pos = n_mine ? atomicAdd(n_cand, n_mine) : 0u;
  for (; mask != 0; mask &= mask - 1, ++pos) {
    const int e = __ffs(static_cast<int>(mask)) - 1;
    const int j = e / kVecTokens<T>, i = e % kVecTokens<T>;
    const int64_t id = ch.start + j * kVecStride<T> + static_cast<int>(threadIdx.x) * kVecTokens<T> + i;
    const T x = (kRegular || vec_staged(ch, vocab, j)) ? mine[j * kVecStride<T> + i] : __ldg(ch.row_ptr + id);
    if (pos < kCandCap) out[pos] = pack_desc(float_key(scaled(to_float(x), inv_t)), id);  // else: overflow
  }
  return has_real ? float_key(scaled(m, inv_t)) : kNoKey;
}

// A chunk filtered with an inherited bound that keeps more than this searches its own bound and filters again.
__device__ __forceinline__ uint32_t refilter_above(int k) { return static_cast<uint32_t>(2 * k); }

// What a block knows of the row it is filtering (reset at each new row). bound (0: none yet): a bound L of this
// row the block certified: at least k tokens of the row are >= L, so the row's k-th largest is >= L and every
// token of the row's top-k (ties included) is >= L, in whichever chunk it lies. run_key: the largest key of
// this thread's tokens in the row's chunks filtered so far. seen: those chunks.
struct RowState {
  uint32_t bound = 0, run_key = kNoKey;
  int seen = 0;
};

// A row's later bounds come from the running maxima: after j chunks, 256 threads' maxima of 32 j tokens each
// (distinct tokens of the row: a certificate as good as one chunk's). Published into sm.maxima at the end of
// the row's chunks j = 2, 4, 8, ... when the row has two more chunks in the block's range; warp 0 searches them
// during chunk j + 1, while the other warps filter it (no barrier of their own), and every thread raises its
// bound with the result in chunk j + 2. Powers of two: each raise about halves what a chunk keeps, and a
// search never overlaps the next publication.
__device__ __forceinline__ bool publishes(int seen) { return seen >= 2 && (seen & (seen - 1)) == 0; }
// fp32 only: for 16-bit logits the running maxima cost the candidates kernel more than select gains (H200,
// docs/kernel-notes.md v16), and without publications the compiler drops them.
template <typename T>
constexpr bool kRunningBound = sizeof(T) == 4;

// One chunk, writing its candidates to out and their count to *count. A chunk with an inherited bound needs no
// bound of its own, unless it keeps more than refilter_above(k) of its tokens: then it searches its own (L'
// certified by its maxima), filters again with max(L, L'), and passes that on. publish: this chunk publishes
// the running maxima; search: warp 0 searches the previous chunk's. The barriers depend only on shared values
// and block-uniform flags, so the whole block takes the same branches. raw_max: emit_kept's (the raw log-probs'
// reference).
template <typename T, bool kRegular>
__device__ __forceinline__ void filter_chunk(const Chunk<T>& ch, int64_t vocab, float inv_t, int k, const T* mine,
                                             uint64_t* out, uint32_t* count, uint32_t* n_cand, RowState& rs,
                                             bool publish, bool search, CandidateSmem& sm, float& raw_max) {
  const bool inherited = rs.bound != 0;
  if (!inherited) rs.bound = chunk_bound<T, kRegular>(ch, vocab, inv_t, k, mine, n_cand, sm);
  if (search && threadIdx.x < 32) {  // sm.maxima: published before the last chunk's end barrier
    const uint32_t l = warp_bound(sm.maxima, k);
    if (threadIdx.x == 0) sm.next_bound = l;
  }
  const uint32_t key = emit_kept<T, kRegular>(ch, vocab, inv_t, rs.bound, mine, out, n_cand, raw_max);
  rs.run_key = max(rs.run_key, key);
  if (publish) sm.maxima[threadIdx.x] = rs.run_key;  // read by warp 0 in the next chunk, after this barrier
  __syncthreads();  // every slot of this chunk is in *n_cand
  uint32_t n = *n_cand;
  if (inherited && n > refilter_above(k)) {
    // (its chunk_bound rewrites sm.maxima: a publication of this chunk is replaced by the chunk's own maxima,
    // still distinct tokens of the row, so the next search stays a certificate, a weaker one)
    const uint32_t own = chunk_bound<T, kRegular>(ch, vocab, inv_t, k, mine, n_cand, sm);
    rs.bound = max(rs.bound, own);
    emit_kept<T, kRegular>(ch, vocab, inv_t, rs.bound, mine, out, n_cand, raw_max);
    __syncthreads();
    n = *n_cand;
  }
  if (threadIdx.x == 0) *count = n;
  ++rs.seen;
}

// ---- raw log-probs (kDrawLogpRaw: rlkernel.sample(..., return_logprobs=True)) ----
// The drawn id's log-prob under softmax(x / T') (T' = T, 1 where T = 0) from the row's online-softmax state of
// y = x * c, c = log2(e) / T' (row_reduce.cuh's RowState: the max and the sum of 2^(y - max), base 2), so that the
// log-prob is the logp forward's own expression of it (target_logp). Where the state comes from:
//  - fast path: the candidates kernel, right after it filters a chunk, sums each warp's tokens of it against
//    the warp's largest (raw max * c, from the filter's own pass: one exponential a token, no rescaling; a
//    thread's vectors in order, each by add_chunk's pairwise tree, then the warp's 32 sums by a butterfly) and
//    stores one state per (chunk, warp); select's warp 0 merges the row's states, lane l taking states l, l + 32,
//    ... in order, then the warp's butterfly. No second read of the logits from memory. Every step is a function
//    of (V, dtype) alone: the same bits whichever block filters a chunk, whether its vectors were staged, and in
//    any batch. Not the logp forward's order (a team of one row's threads walking the whole row), so within a
//    bound of it (docs/contracts.md, section 1).
//  - whole-row path (the row's block reads it anyway, several times): team_row_state with the logp forward's own
//    team (row_team_threads(V)): its state bit for bit, one more read of the row.
using SoftmaxState = ::rlkernel::RowState;
constexpr int kCandWarps = kCandThreads / 32;  // states a chunk stores
static_assert(kRowThreads == kCtaThreads, "the whole-row path runs the logp forward's team reduction");

// c of a row: the scalar temperature's as the logp forward rounds it (host, SampleSettings::raw_c), else from the
// row's float T (T' = 1 where T = 0; a bad T's row draws nothing, so any value)
__device__ __forceinline__ float raw_scale(const SampleSettings& s, int64_t row) {
  if (s.temperature_rows == nullptr) return s.raw_c;
  const float t = s.temperature_rows[row];
  return t > 0.f ? __fdiv_rn(kLog2e, t) : kLog2e;
}

// Candidates kernel: this chunk's state, one per warp, into out[warp]. raw_max: the thread's largest raw logit of
// the chunk (filter_chunk's); the warp's largest, times c (c > 0: rounding keeps the order), is the state's max, and
// every token of the warp costs one exponential against it: no rescaling as a max grows, and the warp's sums add
// by a butterfly with no merge (the kernel is issue-bound: docs/benchmarks.md). A vector not staged (an unaligned
// row, the row's end) is read from global memory into the same registers, -inf past the row: the same bits either
// way.
template <typename T, bool kRegular>
__device__ __forceinline__ void store_chunk_state(const Chunk<T>& ch, int64_t vocab, float c, float raw_max,
                                                  const T* mine, float2* out) {
  constexpr int kVec = ElemTraits<T>::kVec;
  float warp_max = raw_max;
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) warp_max = max_nan(warp_max, __shfl_xor_sync(kFullMask, warp_max, o));
  const float m = warp_max * c;
  const float r = state_ref(m);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kVecsPerThread<T>; ++j) {
    RawVec v;
    if (kRegular || vec_staged(ch, vocab, j)) {
      v.u4 = *reinterpret_cast<const uint4*>(mine + j * kVecStride<T>);
    } else {
      const int64_t e0 = ch.start + j * kVecStride<T> + static_cast<int>(threadIdx.x) * kVecTokens<T>;
      v = e0 < vocab ? load_vec<T>(ch.row_ptr, static_cast<int>(e0), static_cast<int>(vocab), false)
                     : neg_inf_vec<T>();
    }
    float e[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) e[i] = fast_exp2(fmaf(raw_elem<T>(v, i), c, -r));
#pragma unroll
    for (int w = kVec / 2; w >= 1; w /= 2)  // the vector's pairwise tree, as add_chunk sums it
#pragma unroll
      for (int i = 0; i < w; ++i) e[i] = e[i] + e[i + w];
    sum += e[0];
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) sum += __shfl_xor_sync(kFullMask, sum, o);  // every lane adds in one tree
  if (threadIdx.x % 32 == 0) out[threadIdx.x / 32] = make_float2(m, sum);
}

// Select: the row's state from its chunks' n stored states, by warp 0 (lane l merging states l, l + 32, ... in
// order, then the warp's butterfly); no block barrier.
__device__ __forceinline__ SoftmaxState merged_chunk_state(const float2* states, int n) {
  SoftmaxState st = empty_state();
  for (int i = threadIdx.x; i < n; i += 32) {
    const float2 x = states[i];
    st = merge_state<false>(st, SoftmaxState{x.x, x.y, 0.f});
  }
  return warp_merge<false>(st);
}

// The whole-row path: the logp forward's reduction of the row, by its team (threads 0 .. TEAM - 1; the block's
// other threads take part in the barriers only). Every thread of the block calls it.
template <typename T>
__device__ __forceinline__ SoftmaxState whole_row_state(const T* row_ptr, int64_t vocab, float c, TeamSmem& smem) {
  const int v = static_cast<int>(vocab);
  const bool lead = threadIdx.x < static_cast<unsigned>(row_team_threads(vocab, sizeof(T)));
  switch (row_team_threads(vocab, sizeof(T))) {
    case 32: return team_row_state<T, 32, false>(row_ptr, v, c, lead, smem);
    case 64: return team_row_state<T, 64, false>(row_ptr, v, c, lead, smem);
    case 128: return team_row_state<T, 128, false>(row_ptr, v, c, lead, smem);
    case 256: return team_row_state<T, 256, false>(row_ptr, v, c, lead, smem);
    default: return team_row_state<T, kCtaThreads, false>(row_ptr, v, c, lead, smem);
  }
}

// After the draw (every thread of the block calls it; `whole`: the row took the whole-row path, block-uniform):
// thread 0 writes the drawn id's raw log-prob, as the logp forward writes it (target_logp of the same state
// fields). A row with id -1 already has NaN (mark_bad_row).
template <typename T>
__device__ __forceinline__ void write_raw_logp(const T* row_ptr, int64_t vocab, int64_t row, float c, bool whole,
                                               const float2* states, int splits, TeamSmem& smem,
                                               const int64_t* ids, float* logp) {
  SoftmaxState st;
  if (whole) {
    st = whole_row_state(row_ptr, vocab, c, smem);
  } else if (threadIdx.x < 32) {
    st = merged_chunk_state(states + row * splits * kCandWarps, splits * kCandWarps);
  }
  if (threadIdx.x != 0) return;
  const int64_t id = ids[row];  // thread 0 wrote it (the law's writes are thread 0's)
  if (id < 0) return;
  logp[row] = target_logp(ElemTraits<T>::to_float(row_ptr[id]), c, finish_row<false>(st));
}

// Persistent: block b filters the contiguous chunks [b * chunks / G, (b + 1) * chunks / G) of the rows x splits
// grid (row-major), so most of its chunks follow one of the same row and inherit its bound (filter_chunk): one
// pass and one barrier a chunk, no search of their own (warp 0 searches the running maxima in a few of them). The next
// kStages - 1 chunks' copies (cp.async, each thread its own vectors into its own slots) are in flight while this one is
// filtered.
// What the candidates kernel needs of a row's settings: whether the row takes the fast path (a valid row with
// 1 <= k <= kMaxFastK, k < V, or T = 0), its 1/T and its k (1 for argmax). Block-uniform.
struct CandRow {
  bool fast;
  float inv_t;
  int k;
  float c;  // the raw log-probs' scale (raw_scale; unused, and dropped by the compiler, without them)
};

__device__ __forceinline__ CandRow cand_row(const SampleSettings& s, int row, int64_t vocab) {
  const RowSettings r = row_settings(s, row, vocab);
  const bool fast = r.bad < 0 && (r.argmax || (r.top_k >= 1 && r.top_k <= kMaxFastK));
  return CandRow{fast, r.inv_t, static_cast<int>(fast ? r.top_k : 1), raw_scale(s, row)};
}

// A row's chunk the candidates kernel does not filter (the row takes the whole-row path in select): its count says
// "overflow".
constexpr uint32_t kSkippedChunk = kCandCap + 1;

// kLse (raw log-probs): each filtered chunk also stores its per-warp softmax states into states[chunk * kCandWarps
// + warp] (store_chunk_state); the plain draw's instantiation has none of it.
template <typename T, bool kLse = false>
// (The minimum of 3 blocks an SM, what the fp32 stages' 64 KiB allow, caps registers at 80, which they stay well
// under: without it ptxas spilled the fp32 kernel at 48 registers.)
__global__ void __launch_bounds__(kCandThreads, 3)
    rlkernel_sample_candidates(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, int splits,
                               int chunks, SampleSettings settings, uint64_t* __restrict__ cand,
                               uint32_t* __restrict__ counts, float2* __restrict__ states) {
  extern __shared__ __align__(16) unsigned char stage_bytes[];  // kStages x kChunk logits
  __shared__ CandidateSmem sm;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the select grid be scheduled now (launched as a programmatic dependent): its blocks take SMs as this grid's
  // blocks leave them and wait in cudaGridDependencySynchronize, which returns only once this whole grid has
  // completed and its writes are visible. Every block of this grid is resident before any select block is (the
  // trigger counts only once all blocks have called it), so a waiting select block never holds an SM one of
  // these blocks still needs.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  const int begin = static_cast<int>(static_cast<int64_t>(blockIdx.x) * chunks / gridDim.x);
  const int end = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * chunks / gridDim.x);
  if (begin >= end) return;
  const T* mine0 = reinterpret_cast<const T*>(stage_bytes) + threadIdx.x * kVecTokens<T>;  // this thread's slots
  const uint32_t slots0 = static_cast<uint32_t>(__cvta_generic_to_shared(mine0));
  constexpr uint32_t kStageStride = static_cast<uint32_t>(kStageBytes<T>);
  ChunkCursor ahead{begin / splits, begin % splits};  // the next chunk to stage
  int staged = begin;
  for (int s = 0; s < kStages - 1; ++s, ++staged) {
    if (staged < end) {
      stage_chunk(chunk_at(logits, row_stride, vocab, ahead), vocab, slots0 + s * kStageStride);
      ahead.next(splits);
    }
    cp_async_commit();  // possibly empty: one group per chunk slot keeps the wait below exact
  }
  ChunkCursor cur{begin / splits, begin % splits};
  CandRow cr = cand_row(settings, cur.row, vocab);
  RowState rs;
  bool search = false;    // the last chunk published the running maxima: warp 0 searches them in this one
  bool searched = false;  // warp 0 searched them in the last chunk: raise the bound with the result
  for (int it = 0, c = begin; c < end; ++it, ++c, ++staged) {
    if (staged < end) {  // into the stage chunk c - 1 used: every thread is past its last barrier
      const uint32_t slots = slots0 + ((it + kStages - 1) % kStages) * kStageStride;
      stage_chunk(chunk_at(logits, row_stride, vocab, ahead), vocab, slots);
      ahead.next(splits);
    }
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // chunk c's group is complete
    if (threadIdx.x == 0) sm.n_cand[(it + 1) % 3] = 0;  // last read in chunk it - 2, before chunk it - 1's barrier
    const Chunk<T> ch = chunk_at(logits, row_stride, vocab, cur);
    const T* mine = mine0 + (it % kStages) * kChunk;
    uint64_t* out = cand + static_cast<int64_t>(c) * kCandCap;
    if (searched) rs.bound = max(rs.bound, sm.next_bound);  // written before the last chunk's end barrier
    // this chunk is the row's chunk rs.seen + 1; it publishes when the row has two more in the range (one to
    // search in, one to use the result) and it holds a bound (so the next chunk is not searching its own)
    const bool publish = kRunningBound<T> && cr.fast && rs.bound != 0 && publishes(rs.seen + 1) &&
                         cur.split + 2 < splits && c + 2 < end;
    const float inv_t = cr.inv_t;
    const int k = cr.k;
    if (!cr.fast) {
      if (threadIdx.x == 0) counts[c] = kSkippedChunk;
      __syncthreads();  // the end barrier filter_chunk would have had (the n_cand and stage rotations rely on it)
    } else if (ch.regular) {
      float raw_max;
      filter_chunk<T, true>(ch, vocab, inv_t, k, mine, out, counts + c, &sm.n_cand[it % 3], rs, publish, search,
                            sm, raw_max);
      // (reads this thread's own slots only: no barrier; the next chunk's copy into them comes after, in order)
      if constexpr (kLse) {
        store_chunk_state<T, true>(ch, vocab, cr.c, raw_max, mine, states + int64_t{c} * kCandWarps);
      }
    } else {
      float raw_max;
      filter_chunk<T, false>(ch, vocab, inv_t, k, mine, out, counts + c, &sm.n_cand[it % 3], rs, publish, search,
                             sm, raw_max);
      if constexpr (kLse) {
        store_chunk_state<T, false>(ch, vocab, cr.c, raw_max, mine, states + int64_t{c} * kCandWarps);
      }
    }
    searched = search;
    search = publish;
    const int row = cur.row;
    cur.next(splits);
    if (cur.row != row) {  // a bound holds for its own row only
      rs = RowState{};
      search = searched = false;
      if (cur.row < chunks / splits) cr = cand_row(settings, cur.row, vocab);
    }
  }
}

// ---- one warp sorts kRun packed values, descending: element e = 4 * lane + r is v[r] of that lane ----

// One bitonic stage on the pairs (e, e ^ stride): the lower index takes the larger value where bit `size` of e
// is clear, the smaller where it is set (size 0: every pair descending, as the merge needs).
template <int kSize, int kStride>
__device__ __forceinline__ void warp_stage(uint64_t v[4]) {
  const int lane = threadIdx.x % 32;
  if constexpr (kStride >= 4) {  // the partner is lane ^ (stride / 4), same register
    constexpr int kLanes = kStride / 4;
    const bool lower = (lane & kLanes) == 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool desc = ((lane * 4 + r) & kSize) == 0;
      const uint64_t o = __shfl_xor_sync(kFullMask, v[r], kLanes);
      v[r] = (lower == desc) ? (v[r] > o ? v[r] : o) : (v[r] < o ? v[r] : o);
    }
  } else {  // the partner is in this lane's registers
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if ((r & kStride) == 0) {
        const bool desc = ((lane * 4 + r) & kSize) == 0;
        const uint64_t a = v[r], b = v[r + kStride];
        const bool swap = desc ? a < b : a > b;
        v[r] = swap ? b : a;
        v[r + kStride] = swap ? a : b;
      }
    }
  }
}

template <int kSize, int kStride>
__device__ __forceinline__ void warp_merge_stages(uint64_t v[4]) {  // strides kStride, kStride / 2, ..., 1
  warp_stage<kSize, kStride>(v);
  if constexpr (kStride > 1) warp_merge_stages<kSize, kStride / 2>(v);
}

template <int kSize = 2>
__device__ __forceinline__ void warp_sort_run(uint64_t v[4]) {  // any 128 values -> descending
  warp_merge_stages<kSize, kSize / 2>(v);
  if constexpr (kSize < kRun) warp_sort_run<kSize * 2>(v);
}

// v, u: descending runs. v becomes the 128 largest of both, descending: max(v[e], u[127 - e]) is bitonic and
// holds them (a half-cleaner of v followed by reversed u), and a bitonic merge sorts it.
__device__ __forceinline__ void warp_merge_top(uint64_t v[4], const uint64_t u[4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint64_t x = __shfl_sync(kFullMask, u[3 - r], 31 - lane);  // element 127 - e of u
    v[r] = v[r] > x ? v[r] : x;
  }
  warp_merge_stages<0, kRun / 2>(v);
}

__device__ __forceinline__ void load_run(const uint64_t* src, int n, uint64_t u[4]) {  // entries >= n: 0
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 4; ++r) u[r] = lane * 4 + r < n ? src[lane * 4 + r] : 0;  // 0 is below every real entry
}

struct FinishSmem {
  uint64_t mass[kFinishWarps];  // each finishing warp's total of the fixed-point weights
  float score[kFinishWarps];    // and its best (race score, id)
  int64_t id[kFinishWarps];
  uint32_t key[kFinishWarps];   // kDrawLogp: the key of that best entry
  uint64_t kept_mass[kFinishWarps], kept_dmass[kFinishWarps], kept_low[kFinishWarps];  // stats mode
};

// The block, with the row's best n candidates in (key desc, id asc) order in sorted[0, min(n, kRun)) (n >= 1 real
// ones; top_by_threshold's n is at least min(top_k, the row's candidates)): the same law as filter_and_draw on the
// first m = min(top_k, n), in the same integer arithmetic, so the same kept set (and, with the same Philox noise per
// (row, id), the same drawn id; in stats mode the same KeptStats, to thread 0; kDrawLogp: the drawn id and its
// processed log-prob, from the same kept mass). Entry e is thread e's (warps 0 .. kFinishWarps - 1): its weight,
// its Philox draw and its logs run once per thread, not four times in a row on one warp (which made this the
// longest stage of select). Every thread of the block calls it.
template <int kMode>
__device__ __forceinline__ KeptStats finish_sorted(const uint64_t* sorted, int n, const FilterArgs& a,
                                                   FinishSmem& f) {
  KeptStats out{false, 0.f, 0, 0, 0};
  const int e = threadIdx.x, warp = e / 32, lane = e % 32;
  const uint32_t top_key = static_cast<uint32_t>(sorted[0] >> 32);
  const float s_max = key_float(top_key);
  const bool bad = a.argmax ? (top_key == kNanKey || top_key <= float_key(-INFINITY))
                            : (top_key == kNanKey || isinf(s_max));  // NaN sorts first: it is the top
  if (bad || a.argmax) {  // the same for every thread: no barrier below is skipped by some only
    if (e == 0) {
      if (kMode == kStats) {
        out = KeptStats{!bad, s_max, uint64_t{1} << 40, 0, sorted[0]};
      } else if (bad) {
        mark_bad_row(a);  // (kDrawLogp: log-prob NaN)
      } else {
        a.ids[a.row] = unpack_id(sorted[0]);
        // the argmax's scaled logit is s_max itself: (s - s_max) - 0, as write_processed computes it
        if (kMode == kDrawLogp) write_drawn_logp(a, s_max, s_max, uint64_t{1} << 40);
      }
    }
    return out;
  }
  const int m = a.top_k < n ? static_cast<int>(a.top_k) : n;  // <= kMaxFastK <= kRun
  const uint64_t v = e < m ? sorted[e] : 0;
  const uint32_t key = static_cast<uint32_t>(v >> 32);
  const uint64_t w = e < m ? fixed_weight(key, s_max) : 0;
  uint64_t inc = w;  // inclusive prefix over this warp's entries
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t x = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += x;
  }
  if (lane == 31 && warp < kFinishWarps) f.mass[warp] = inc;
  __syncthreads();
  uint64_t z = 0, before = inc - w;  // before: mass of the entries ahead of e
#pragma unroll
  for (int i = 0; i < kFinishWarps; ++i) {
    z += f.mass[i];
    before += i < warp ? f.mass[i] : 0;
  }
  const uint64_t target = top_p_target(a.top_p, z);
  // top-p: kept while the mass before it is < top_p * Z; then min_p: s >= s_max + ln(min_p)
  const bool kept = e < m && (a.top_p >= 1.0 || before < target) &&
                    key_float(key) >= min_p_floor(s_max, a.log_min_p);
  if (kMode == kStats) {
    uint64_t km = kept ? w : 0, kd = kept ? fixed_dweight(key, s_max) : 0, low = kept ? ~v : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      km += __shfl_xor_sync(kFullMask, km, o);
      kd += __shfl_xor_sync(kFullMask, kd, o);
      const uint64_t l = __shfl_xor_sync(kFullMask, low, o);
      low = l > low ? l : low;
    }
    if (lane == 0 && warp < kFinishWarps) {
      f.kept_mass[warp] = km;
      f.kept_dmass[warp] = kd;
      f.kept_low[warp] = low;
    }
    __syncthreads();
    if (e == 0) {
      for (int i = 1; i < kFinishWarps; ++i) {
        km += f.kept_mass[i];
        kd += f.kept_dmass[i];
        low = f.kept_low[i] > low ? f.kept_low[i] : low;
      }
      out = KeptStats{true, s_max, km, kd, ~low};
    }
    return out;
  }
  // the race; kDrawLogp also carries the best entry's key along (its scaled logit: key_float inverts float_key)
  // and sums the kept mass as stats mode does (integers: the same total in any order)
  float bs = -INFINITY;
  int64_t bi = INT64_MAX;
  uint32_t bk = 0;
  uint64_t km = kept ? w : 0;
  if (kept) {
    bi = unpack_id(v);
    bk = key;
    bs = race_score(key_float(key), a.noise.rng, a.noise.word, bi);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float so = __shfl_xor_sync(kFullMask, bs, o);
    const int64_t io = __shfl_xor_sync(kFullMask, bi, o);
    uint32_t ko = 0;
    if (kMode == kDrawLogp) {
      ko = __shfl_xor_sync(kFullMask, bk, o);
      km += __shfl_xor_sync(kFullMask, km, o);
    }
    if (better(so, io, bs, bi)) {
      bs = so;
      bi = io;
      bk = ko;
    }
  }
  if (lane == 0 && warp < kFinishWarps) {
    f.score[warp] = bs;
    f.id[warp] = bi;
    if (kMode == kDrawLogp) {
      f.key[warp] = bk;
      f.kept_mass[warp] = km;
    }
  }
  __syncthreads();
  if (e == 0) {
#pragma unroll
    for (int i = 1; i < kFinishWarps; ++i) {
      if (better(f.score[i], f.id[i], bs, bi)) {
        bs = f.score[i];
        bi = f.id[i];
        if (kMode == kDrawLogp) bk = f.key[i];
      }
      if (kMode == kDrawLogp) km += f.kept_mass[i];
    }
    a.ids[a.row] = bi;
    if (kMode == kDrawLogp) write_drawn_logp(a, key_float(bk), s_max, km);
  }
  return out;
}

static_assert(kRowCandThreads == kRowThreads, "the candidate list's block is the whole-row path's");

struct SelectSmem {
  union {
    RowLawSmem law;                  // the whole-row path (row_law)
    uint64_t sorted[kMaxSmemCand];   // the candidates
    TeamSmem team;                   // raw log-probs, after the draw (team_merge's barrier comes before its writes)
  };
  uint32_t offset[kRowThreads];
  uint32_t scan[32];
  uint64_t top[kRun];  // top_by_threshold: the candidates at or above its threshold
  uint32_t n_top;
  FinishSmem finish;
};

constexpr int kCandPerThread = kMaxSmemCand / kRowThreads;  // candidates each select thread holds, at most
static_assert(kRowThreads / 32 <= 16, "top_by_threshold: two reductions of one value a warp in sm.scan");

// The row's best min(k, n) candidates (sm.sorted[0, n)) in (key desc, id asc) order into sm.sorted[0, m), without
// sorting all n: a key tau with at least k candidates at or above it (every candidate of the row's top-k is then
// >= tau, ties at the k-th key included) and few of them, found bit by bit from the candidates' common prefix with
// one block-wide count a bit, stopping once at most `few` remain; then those m candidates ranked by counting
// (their packed values are distinct). Returns m, or 0 (sm.sorted untouched) when n is 0 or more than kRun share
// the keys from tau up (ties at the k-th key): the sort below takes over. Block-uniform; every thread calls it.
// (It replaced select's sort of every candidate, whose chains of warp shuffles were the longest part of select:
// docs/kernel-notes.md, v16.)
__device__ __forceinline__ int top_by_threshold(SelectSmem& sm, int n, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per = (n + kRowThreads - 1) / kRowThreads;  // block-uniform
  uint32_t key[kCandPerThread];
  uint32_t any = 0, all = ~0u;
#pragma unroll
  for (int e = 0; e < kCandPerThread; ++e) {
    const int i = static_cast<int>(threadIdx.x) + e * kRowThreads;
    key[e] = i < n ? static_cast<uint32_t>(sm.sorted[i] >> 32) : kNoKey;  // kNoKey: below every threshold tried
    if (i < n) {
      any |= key[e];
      all &= key[e];
    }
  }
  any = __reduce_or_sync(kFullMask, any);
  all = __reduce_and_sync(kFullMask, all);
  if (lane == 0) {
    sm.scan[warp] = any;
    sm.scan[16 + warp] = all;
  }
  if (threadIdx.x == 0) sm.n_top = 0;
  __syncthreads();
  any = 0;
  all = ~0u;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) {
    any |= sm.scan[w];
    all &= sm.scan[16 + w];
  }
  // every candidate is >= their common prefix (the bits above the highest bit where they differ)
  const uint32_t differ = any ^ all;
  int b = differ ? 31 - __clz(static_cast<int>(differ)) : -1;
  uint32_t tau = b < 0 ? any : any & ~((2u << b) - 1u);
  int cnt = n;  // candidates >= tau
  const int few = min(kRun, max(2 * k, 32));  // >= k: the loop never runs when n < k
  for (; b >= 0 && cnt > few; --b) {
    const uint32_t cb = tau | (1u << b);
    int c = 0;
#pragma unroll
    for (int e = 0; e < kCandPerThread; ++e) {
      if (e < per) c += __syncthreads_count(key[e] >= cb);
    }
    if (c >= k) {
      tau = cb;
      cnt = c;
    }
  }
  if (cnt > kRun) return 0;
#pragma unroll
  for (int e = 0; e < kCandPerThread; ++e) {
    const int i = static_cast<int>(threadIdx.x) + e * kRowThreads;
    if (i < n && key[e] >= tau) sm.top[atomicAdd(&sm.n_top, 1u)] = sm.sorted[i];
  }
  __syncthreads();  // sm.top holds the cnt candidates; nothing reads sm.sorted any more
  if (static_cast<int>(threadIdx.x) < cnt) {
    const uint64_t v = sm.top[threadIdx.x];
    int rank = 0;
#pragma unroll 4
    for (int j = 0; j < cnt; ++j) rank += sm.top[j] > v;
    sm.sorted[rank] = v;
  }
  __syncthreads();
  return cnt;
}

// ---- the processed log-prob outputs (stats mode) ----

// Writes one row's processed log-prob, entropy, stats and threshold (thread 0). k.ok false: NaN (no distribution).
template <typename T>
__device__ __forceinline__ void write_processed(const T* row_ptr, int64_t row, int64_t id, const RowSettings& r,
                                                const KeptStats& k, const ProcessedOut& o) {
  if (!k.ok) {
    o.logp[row] = NAN;
    if (o.entropy) o.entropy[row] = NAN;
    reinterpret_cast<float4*>(o.stats)[row] = make_float4(NAN, NAN, NAN, NAN);
    o.threshold[row] = 0;
    return;
  }
  const double log_s = log_kept_mass(k.mass, r.argmax);  // the draw's log-prob (kDrawLogp) takes the same two
  const float h = r.argmax ? 0.f
                           : static_cast<float>(static_cast<double>(k.dmass) / static_cast<double>(k.mass) + log_s);
  const float ls = static_cast<float>(log_s);
  const float s = scaled(to_float(row_ptr[id]), r.inv_t);
  const bool kept = pack_desc(float_key(s), id) >= k.threshold;
  o.logp[row] = kept ? kept_logp(s, k.s_max, ls) : -INFINITY;
  if (o.entropy) o.entropy[row] = h;
  reinterpret_cast<float4*>(o.stats)[row] = make_float4(k.s_max, ls, h, r.argmax ? 0.f : r.inv_t);
  o.threshold[row] = static_cast<int64_t>(k.threshold);
}

// What a row needs before any filtering, the same in every kernel (block-uniform; thread 0 writes): returns false
// when the row is done (draw modes: a bad setting, id -1, kDrawLogp's log-prob NaN; stats mode: an ignored row, a
// bad setting, a bad id).
template <int kMode>
__device__ __forceinline__ bool row_prologue(int64_t row, int64_t vocab, const RowSettings& r, int64_t* ids,
                                             const ProcessedOut& o, const ErrorSink& errors, int64_t* id_out) {
  const bool first = threadIdx.x == 0;
  if (kMode != kStats) {
    if (r.bad < 0) return true;
    if (first) {
      ids[row] = -1;
      if (draws_logp(kMode)) o.logp[row] = NAN;
      report_bad_arg(errors, row, r.bad);
    }
    return false;
  }
  const int64_t id = o.ids[row];
  *id_out = id;
  const bool ignored = id == o.ignore_index;
  const bool bad_id = !ignored && (id < 0 || id >= vocab);
  if (!ignored && r.bad < 0 && !bad_id) return true;
  if (first) {
    const float v = ignored ? 0.f : NAN;
    o.logp[row] = v;
    if (o.entropy) o.entropy[row] = v;
    reinterpret_cast<float4*>(o.stats)[row] = make_float4(v, v, v, 0.f);
    o.threshold[row] = 0;
    if (!ignored && r.bad >= 0) {
      report_bad_arg(errors, row, r.bad);
    } else if (bad_id) {
      report_error(errors, row, id);
    }
  }
  return false;
}

// One row's law in select (kMode: law_mode of the kernel's), after its prologue: the candidates path, or the
// whole-row path for a row that is not fast or whose candidates overflow. Returns whether it took the whole-row path
// (block-uniform). Every thread of the block calls it.
template <typename T, int kMode>
__device__ __forceinline__ bool select_row(const T* __restrict__ logits, int64_t row_stride, int64_t vocab,
                                           int splits, const uint64_t* __restrict__ cand,
                                           const uint32_t* __restrict__ counts, int64_t row, const RowSettings& rset,
                                           int64_t id, const FilterArgs& args, const ProcessedOut& out,
                                           SelectSmem& sm) {
  const T* row_ptr = logits + row * row_stride;
  const bool fast = rset.argmax || (args.top_k >= 1 && args.top_k <= kMaxFastK);
  // splits <= kRowThreads (the launcher checks): one thread per chunk
  const uint32_t c = threadIdx.x < splits ? counts[row * splits + threadIdx.x] : 0u;
  const int overflow = __syncthreads_or(c > kCandCap);
  uint32_t total;
  const uint32_t before = block_exclusive_scan<kRowThreads>(c, sm.scan, &total);
  if (!fast || overflow || total > kMaxSmemCand) {
    const KeptStats k = row_law<kMode>(row_ptr, vocab, rset, args, sm.law);
    if (kMode == kStats && threadIdx.x == 0) write_processed(row_ptr, row, id, rset, k, out);
    return true;
  }
  if (threadIdx.x < splits) sm.offset[threadIdx.x] = before;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int s = warp; s < splits; s += kRowThreads / 32) {  // one warp copies one chunk's candidates
    const uint64_t* src = cand + (row * splits + s) * kCandCap;
    uint64_t* dst = sm.sorted + sm.offset[s];
    const uint32_t n = (s + 1 < splits ? sm.offset[s + 1] : total) - sm.offset[s];
    constexpr int kInFlight = 4;  // loads a lane issues before its first store: one L2 round trip, not four
    for (uint32_t e0 = lane; e0 < n; e0 += kInFlight * 32) {
      uint64_t x[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) x[i] = e0 + i * 32 < n ? src[e0 + i * 32] : 0;
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (e0 + i * 32 < n) dst[e0 + i * 32] = x[i];
      }
    }
  }
  __syncthreads();
  const int m = top_by_threshold(sm, static_cast<int>(total), static_cast<int>(args.top_k));
  if (m > 0) {
    const KeptStats k = finish_sorted<kMode>(sm.sorted, m, args, sm.finish);
    if (kMode == kStats && threadIdx.x == 0) write_processed(row_ptr, row, id, rset, k, out);
    return false;
  }
  // many ties at the k-th key: each warp sorts runs of 128 candidates and keeps the best 128 of its runs; then a
  // tree of merges across the warps (through shared memory, two barriers a level) leaves the row's best 128 in
  // warp 0
  constexpr int kWarps = kRowThreads / 32;
  const int runs = (static_cast<int>(total) + kRun - 1) / kRun;  // 1 .. kMaxSmemCand / kRun
  uint64_t v[4], u[4];
  for (int r = warp; r < runs; r += kWarps) {
    load_run(sm.sorted + r * kRun, static_cast<int>(total) - r * kRun, u);
    warp_sort_run(u);
    if (r == warp) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = u[i];
    } else {
      warp_merge_top(v, u);
    }
  }
  for (int live = runs < kWarps ? runs : kWarps; live > 1;) {
    const int half = (live + 1) / 2;
    __syncthreads();  // the previous readers of sm.sorted are done
    if (warp >= half && warp < live) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sm.sorted[(warp - half) * kRun + lane * 4 + i] = v[i];
    }
    __syncthreads();
    if (warp < live - half) {
      load_run(sm.sorted + warp * kRun, kRun, u);
      warp_merge_top(v, u);
    }
    live = half;
  }
  __syncthreads();  // the merges' last reads of sm.sorted are done
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sm.sorted[lane * 4 + i] = v[i];
  }
  __syncthreads();
  const KeptStats k = finish_sorted<kMode>(sm.sorted, static_cast<int>(total), args, sm.finish);
  if (kMode == kStats && threadIdx.x == 0) write_processed(row_ptr, row, id, rset, k, out);
  return false;
}

// (Two blocks an SM, so 256 rows are one wave on an H200's 132 SMs: without the minimum ptxas also settled on 64
// registers for fp32, but with a spill.) kMode (sampling_filter.cuh): kDraw draws; kStats is the processed log-prob
// forward, same kept set; kDrawLogp draws and writes the drawn id's processed log-prob to out.logp (out.ids unused);
// kDrawLogpRaw draws as kDraw and then writes its raw log-prob to out.logp from the candidates kernel's chunk states
// (`states`; nullptr in the other modes) or, on the whole-row path, the logp forward's reduction of the row.
template <typename T, int kMode>
__global__ void __launch_bounds__(kRowThreads, 2)
    rlkernel_sample_select(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, int splits,
                           const uint64_t* __restrict__ cand, const uint32_t* __restrict__ counts,
                           SampleSettings settings, int64_t* ids, ProcessedOut out, ErrorSink errors,
                           const float2* __restrict__ states) {
  __shared__ SelectSmem sm;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // launched as a programmatic dependent of the candidates grid (Hopper+): from here on its writes are visible
  cudaGridDependencySynchronize();
#endif
  const int64_t row = blockIdx.x;
  const RowSettings rset = row_settings(settings, row, vocab);
  int64_t id = 0;
  if (!row_prologue<kMode>(row, vocab, rset, ids, out, errors, &id)) return;
  const FilterArgs args = filter_args(rset, settings, vocab, row, kMode != kStats, ids,
                                      draws_logp(kMode) ? out.logp : nullptr, errors);
  const bool whole = select_row<T, law_mode(kMode)>(logits, row_stride, vocab, splits, cand, counts, row, rset, id,
                                                    args, out, sm);
  if constexpr (kMode == kDrawLogpRaw) {
    write_raw_logp(logits + row * row_stride, vocab, row, raw_scale(settings, row), whole, states, splits, sm.team,
                   ids, out.logp);
  }
}

template <bool kCandList>
union RowsSmem {
  std::conditional_t<kCandList, RowLawSmem, RadixSmem> law;
  TeamSmem team;  // raw log-probs, after the draw (team_merge's barrier comes before its writes)
};

// kCandList: top-k rows run on their candidate list (row_law); the launcher picks it only where some row can (a
// scalar 1 <= top_k <= kMaxRowCandK, or a per-row top_k), because the list's code costs the kernel registers (40 ->
// 64 for <bf16, 1>: 3 -> 2 blocks an SM) that the whole-row law alone (top_p / min_p rows) runs slower without.
template <typename T, int kMode, bool kCandList>
__global__ void __launch_bounds__(kRowThreads)
    rlkernel_sample_rows(const T* __restrict__ logits, int64_t row_stride, int64_t vocab, SampleSettings settings,
                         int64_t* ids, ProcessedOut out, ErrorSink errors) {
  __shared__ RowsSmem<kCandList> sm;
  const int64_t row = blockIdx.x;
  const RowSettings rset = row_settings(settings, row, vocab);
  int64_t id = 0;
  if (!row_prologue<kMode>(row, vocab, rset, ids, out, errors, &id)) return;
  const FilterArgs args = filter_args(rset, settings, vocab, row, kMode != kStats, ids,
                                      draws_logp(kMode) ? out.logp : nullptr, errors);
  const T* row_ptr = logits + row * row_stride;
  const KeptStats k = [&] {
    if constexpr (kCandList) {
      return row_law<law_mode(kMode)>(row_ptr, vocab, rset, args, sm.law);
    } else {
      return filter_and_draw<kRowThreads, law_mode(kMode)>(RowSource<T, kRowThreads>{row_ptr, vocab, rset.inv_t},
                                                           args, sm.law);
    }
  }();
  if (kMode == kStats && threadIdx.x == 0) write_processed(row_ptr, row, id, rset, k, out);
  if constexpr (kMode == kDrawLogpRaw) {
    write_raw_logp(row_ptr, vocab, row, raw_scale(settings, row), true, nullptr, 0, sm.team, ids, out.logp);
  }
}

}  // namespace sampling
}  // namespace rlkernel
