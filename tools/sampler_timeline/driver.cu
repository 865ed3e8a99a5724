// The sampler's timeline (tools/sampler_timeline.sh builds and runs it): sample_launch timed with CUDA events on
// buffers that rotate past the L2 (fp32 or bf16 logits, randn * 3, top_k 50, top_p 0.9, T 1), then one call
// on a cold buffer whose probes (instrument.py) are read back: when each candidates block starts and ends, how
// many blocks are resident over time, the candidates a row, and select's phases.
//   nvcc -O3 -std=c++17 -arch=sm_90a -I DIR -I DIR/include driver.cu -o timeline   (DIR: instrument.py's copy)
//   ./timeline B V [bf16]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "sampling.cu"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

__global__ void fill_normal(float* x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    rlkernel::sampling::U32x4 r = rlkernel::sampling::philox4x32_10({(uint32_t)i, (uint32_t)(i >> 32), 7, 9}, seed, 1);
    float u1 = ((r.x >> 8) + 0.5f) / 16777216.f, u2 = (r.y >> 8) / 16777216.f;
    x[i] = scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
  }
}
__global__ void to_bf16(const float* x, __nv_bfloat16* y, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}

static double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * (v.size() - 1) + 0.5))];
}

int main(int argc, char** argv) {
  using namespace rlkernel::sampling;
  const int64_t B = argc > 1 ? atoll(argv[1]) : 256, V = argc > 2 ? atoll(argv[2]) : 128256;
  const bool bf16 = argc > 3 && std::string(argv[3]) == "bf16";
  if (argc > 4 || B < 1 || B > 512 || V < 8192 || (argc > 3 && !bf16)) {  // probes hold 512 select rows
    fprintf(stderr, "usage: timeline B V [bf16]   (1 <= B <= 512, V >= 8192)\n");
    return 2;
  }
  const int reps = 100, k = 50;
  const double p = 0.9;
  const size_t esz = bf16 ? 2 : 4, bytes = B * V * esz;
  const int nbuf = std::max<int>(2, (int)(3 * 60e6 / bytes) + 1);
  std::vector<void*> bufs(nbuf);
  float* tmp = nullptr;
  if (bf16) CK(cudaMalloc(&tmp, B * V * 4));
  for (int i = 0; i < nbuf; ++i) {
    CK(cudaMalloc(&bufs[i], bytes));
    if (bf16) { fill_normal<<<1024, 256>>>(tmp, B * V, 11 + i, 3.f); to_bf16<<<1024, 256>>>(tmp, (__nv_bfloat16*)bufs[i], B * V); }
    else fill_normal<<<1024, 256>>>((float*)bufs[i], B * V, 11 + i, 3.f);
  }
  const size_t ws = rlkernel::sample_workspace_bytes(B, V, 1.f, k);
  void* wsp; int64_t* ids;
  CK(cudaMalloc(&wsp, ws)); CK(cudaMalloc(&ids, B * 8));
  const rlkernel::ErrorSink no_errors{};  // random normal logits: every row has a distribution
  const rlkernel::ElemType dt = bf16 ? rlkernel::ElemType::kBFloat16 : rlkernel::ElemType::kFloat32;
  auto call = [&](int i) {
    rlkernel::PhiloxArgs rng; rng.seed = 123; rng.offset = 4 * i;
    const char* m = rlkernel::sample_launch(bufs[i % nbuf], dt, B, V, V, 1.f, k, p, rng, ids, no_errors, wsp, ws, nullptr);
    if (m) { printf("launch: %s\n", m); exit(1); }
  };
  for (int i = 0; i < 5; ++i) call(i);
  CK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) { CK(cudaEventRecord(ev[2 * i])); call(i); CK(cudaEventRecord(ev[2 * i + 1])); CK(cudaEventSynchronize(ev[2 * i + 1])); }
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) { float ms; CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1])); us.push_back(ms * 1e3); }
  printf("B=%lld V=%lld %s: sample_launch median %.1f us (p10 %.1f, p90 %.1f) over %d calls, %d buffers\n",
         (long long)B, (long long)V, bf16 ? "bf16" : "fp32", pct(us, .5), pct(us, .1), pct(us, .9), reps, nbuf);
  // one probed call on a cold buffer (probes zeroed first: a select row that left the threshold path keeps 0s)
  call(1); CK(cudaDeviceSynchronize());
  {
    static unsigned long long z[2048 * 20] = {};
    CK(cudaMemcpyToSymbol(rlk_tl_cand, z, sizeof(unsigned long long) * 2048 * 20));
    CK(cudaMemcpyToSymbol(rlk_tl_sel, z, sizeof(long long) * 512 * 8));
    CK(cudaMemcpyToSymbol(rlk_tl_sel_g, z, sizeof(unsigned long long) * 512 * 2));
    CK(cudaMemcpyToSymbol(rlk_tl_cand_n, z, sizeof(int) * 2048));
  }
  call(0); CK(cudaDeviceSynchronize());
  static unsigned long long tc[2048][20]; static unsigned sm_of[2048]; static long long ts[512][8];
  static unsigned long long tsg[512][2]; static unsigned ssm[512];
  CK(cudaMemcpyFromSymbol(tc, rlk_tl_cand, sizeof(tc))); CK(cudaMemcpyFromSymbol(sm_of, rlk_tl_cand_sm, sizeof(sm_of)));
  CK(cudaMemcpyFromSymbol(ts, rlk_tl_sel, sizeof(ts))); CK(cudaMemcpyFromSymbol(tsg, rlk_tl_sel_g, sizeof(tsg)));
  CK(cudaMemcpyFromSymbol(ssm, rlk_tl_sel_sm, sizeof(ssm)));
  static int tn[2048]; CK(cudaMemcpyFromSymbol(tn, rlk_tl_cand_n, sizeof(tn)));
  const int64_t splits = (V + kChunk - 1) / kChunk, chunks = B * splits;
  int dev = 0; CK(cudaGetDevice(&dev));
  const int G = (int)std::min<int64_t>(chunks, (bf16 ? rlkernel::fast_path_device<__nv_bfloat16>(dev).candidate_blocks : rlkernel::fast_path_device<float>(dev).candidate_blocks));
  unsigned long long t0 = ~0ull, tend = 0;
  for (int b = 0; b < G; ++b) t0 = std::min(t0, tc[b][0]);
  std::vector<double> st, en, first, rest;
  std::map<int, std::vector<double>> end_by_n, end_by_per_sm;
  std::map<unsigned, int> per_sm;
  for (int b = 0; b < G; ++b) per_sm[sm_of[b]]++;
  for (int b = 0; b < G; ++b) {
    const int n = tn[b];  // chunks the block filtered (its range, or with a queue what it took)
    const double s = (tc[b][0] - t0) * 1e-3, e = (tc[b][std::min(n, 19)] - t0) * 1e-3;
    tend = std::max<unsigned long long>(tend, tc[b][std::min(n, 19)]);
    st.push_back(s); en.push_back(e); first.push_back((tc[b][1] - tc[b][0]) * 1e-3);
    for (int i = 2; i <= std::min(n, 19); ++i) rest.push_back((tc[b][i] - tc[b][i - 1]) * 1e-3);
    end_by_n[n].push_back(e); end_by_per_sm[per_sm[sm_of[b]]].push_back(e);
  }
  printf("candidates: %d blocks on %zu SMs, %lld chunks; times in us from the first block start\n", G, per_sm.size(), (long long)chunks);
  printf("  block start p0 %.2f p50 %.2f p90 %.2f max %.2f\n", pct(st, 0), pct(st, .5), pct(st, .9), pct(st, 1));
  printf("  block end   p0 %.2f p10 %.2f p50 %.2f p90 %.2f max %.2f\n", pct(en, 0), pct(en, .1), pct(en, .5), pct(en, .9), pct(en, 1));
  printf("  first chunk (start..end) p50 %.2f max %.2f; later chunks p10 %.2f p50 %.2f p90 %.2f max %.2f\n", pct(first, .5), pct(first, 1), pct(rest, .1), pct(rest, .5), pct(rest, .9), pct(rest, 1));
  for (auto& kv : end_by_n) printf("  blocks with %d chunks: %zu, end p50 %.2f max %.2f\n", kv.first, kv.second.size(), pct(kv.second, .5), pct(kv.second, 1));
  for (auto& kv : end_by_per_sm) printf("  blocks on SMs holding %d: %zu, end p50 %.2f max %.2f\n", kv.first, kv.second.size(), pct(kv.second, .5), pct(kv.second, 1));
  {  // is a slow block slow because of its SM? spread of the SMs' mean block end vs the spread within an SM
    std::map<unsigned, std::vector<double>> by_sm;
    for (int b = 0; b < G; ++b) by_sm[sm_of[b]].push_back(en[b]);
    std::vector<double> sm_mean, within;
    for (auto& kv : by_sm) {
      double m = 0; for (double x : kv.second) m += x; m /= kv.second.size(); sm_mean.push_back(m);
      for (double x : kv.second) within.push_back(x - m);
    }
    printf("  SM mean end p0 %.2f p50 %.2f max %.2f; block end minus its SM mean p0 %.2f p50 %.2f max %.2f\n",
           pct(sm_mean, 0), pct(sm_mean, .5), pct(sm_mean, 1), pct(within, 0), pct(within, .5), pct(within, 1));
    // bytes per us while blocks run: first-chunk ramp excluded
  }
  // active-block count over time, in 2 us bins
  printf("  resident candidates blocks by time:");
  for (double t = 0; t < (tend - t0) * 1e-3 + 2; t += 2) {
    int n = 0; for (int b = 0; b < G; ++b) n += st[b] <= t && en[b] > t;
    printf(" %.0f:%d", t, n);
  }
  printf("\n");
  // candidates per row
  std::vector<uint32_t> counts(chunks);
  CK(cudaMemcpy(counts.data(), (uint64_t*)wsp + chunks * kCandCap, chunks * 4, cudaMemcpyDeviceToHost));
  std::vector<double> per_row, per_split(splits, 0.0);
  for (int64_t r = 0; r < B; ++r) { double s = 0; for (int64_t j = 0; j < splits; ++j) { s += counts[r * splits + j]; per_split[j] += counts[r * splits + j] / (double)B; } per_row.push_back(s); }
  printf("  candidates a row: p50 %.0f max %.0f; mean a chunk by split:", pct(per_row, .5), pct(per_row, 1));
  for (auto v : per_split) printf(" %.0f", v);
  printf("\n");
  const int nsel = (int)std::min<int64_t>(B, 512);
  std::vector<double> gs, ge, ph[5];
  int partial = 0;  // rows that left the threshold path (ties, or the whole-row path): probes 4-5 missing
  for (int r = 0; r < nsel; ++r) {
    if (ts[r][5] == 0 || tsg[r][1] == 0) { ++partial; continue; }
    gs.push_back(((double)tsg[r][0] - (double)t0) * 1e-3); ge.push_back(((double)tsg[r][1] - (double)t0) * 1e-3);
    for (int i = 0; i < 5; ++i) ph[i].push_back((ts[r][i + 1] - ts[r][i]) / 1.98e3);  // cycles -> us at ~1.98 GHz
  }
  if (partial) printf("select: %d rows off the threshold path, not in the figures below\n", partial);
  printf("select: last candidates block ended %.2f; select past its wait: p0 %.2f p50 %.2f max %.2f; select end p50 %.2f max %.2f\n",
         (tend - t0) * 1e-3, pct(gs, 0), pct(gs, .5), pct(gs, 1), pct(ge, .5), pct(ge, 1));
  const char* names[5] = {"wait", "counts+scan", "copy", "threshold+rank", "finish"};
  printf("  phases (clock64 at ~1.98 GHz, us) p50/max:");
  for (int i = 0; i < 5; ++i) printf(" %s %.2f/%.2f", names[i], pct(ph[i], .5), pct(ph[i], 1));
  printf("\n");
  std::map<unsigned, int> sel_per_sm;
  for (int r = 0; r < nsel; ++r) sel_per_sm[ssm[r]]++;
  std::map<int, int> hist;
  for (auto& kv : sel_per_sm) hist[kv.second]++;
  printf("  select blocks per SM:"); for (auto& kv : hist) printf(" %d SMs hold %d;", kv.second, kv.first); printf("\n");
  return 0;
}
