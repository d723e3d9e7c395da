// The rate of the instruction the portable MLA kernel runs (mma.sync m16n8k16, bf16 in, fp32 accumulate), measured
// with W warps on each SM sub-partition and C independent accumulator chains a warp: C = 1 gives the dependent-issue
// latency, C >= 4 the sub-partition's peak. bench/compute_rates.py builds this into a shared library (with csrc/ on
// the include path: it times the kernels' own wrapper, dev::mma_bf16) and calls it.
#include <cuda_runtime.h>

#include <cstdint>

#include "device_utils.cuh"

namespace {

using ddtree::dev::mma_bf16;

constexpr int kMmaPerRound = 72;

template <int C>
__global__ void mma_chains(float* out, int rounds, uint32_t seed) {
  const uint32_t a[4] = {seed, seed * 3u, seed * 5u, seed * 7u};
  const uint32_t b0 = seed ^ threadIdx.x, b1 = seed + threadIdx.x;
  float acc[C][4] = {};
  for (int r = 0; r < rounds; ++r) {
#pragma unroll
    for (int i = 0; i < kMmaPerRound; ++i) mma_bf16(acc[i % C], a, b0 + i, b1);
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the chains alive
}

template <int C>
cudaError_t time_chains(int warps_per_smsp, int sms, float* out, float* ms) {
  const int rounds = 2000, threads = 128 * warps_per_smsp;  // 4 sub-partitions a SM
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  mma_chains<C><<<sms, threads>>>(out, 10, 1u);  // warm-up
  cudaEventRecord(e0);
  mma_chains<C><<<sms, threads>>>(out, rounds, 1u);
  cudaEventRecord(e1);
  cudaError_t err = cudaEventSynchronize(e1);
  if (err == cudaSuccess) err = cudaGetLastError();
  cudaEventElapsedTime(ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return err;
}

}  // namespace

// Fills tflops (whole GPU) and ns_per_mma (one warp's time per mma) for `chains` in {1, 2, 4, 8}; 0 on success, else
// the CUDA error code (or -1 for an unsupported chain count).
extern "C" int mma_sync_rate(int device, int warps_per_smsp, int chains, double* tflops, double* ns_per_mma) {
  cudaSetDevice(device);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  float* out = nullptr;
  if (cudaMalloc(&out, sizeof(float) * sms * 128 * warps_per_smsp) != cudaSuccess) return 2;
  float ms = 0.f;
  cudaError_t err;
  switch (chains) {
    case 1: err = time_chains<1>(warps_per_smsp, sms, out, &ms); break;
    case 2: err = time_chains<2>(warps_per_smsp, sms, out, &ms); break;
    case 4: err = time_chains<4>(warps_per_smsp, sms, out, &ms); break;
    case 8: err = time_chains<8>(warps_per_smsp, sms, out, &ms); break;
    default: cudaFree(out); return -1;
  }
  cudaFree(out);
  if (err != cudaSuccess) return static_cast<int>(err);
  const double mma_per_warp = 2000.0 * kMmaPerRound;
  *ns_per_mma = ms * 1e6 / mma_per_warp;
  *tflops = sms * 4.0 * warps_per_smsp * mma_per_warp * 4096.0 / (ms * 1e-3) / 1e12;
  return 0;
}

// The SM clock the chain counts are converted at (kHz).
extern "C" int max_clock_khz(int device) {
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  return khz;
}
