// The per-device cache: facts the launches need from a GPU, queried once per device (at the op's first call, before
// any CUDA-graph capture) and kept, so no launch queries the driver; through the CUDA runtime, because
// ATen/cuda/CUDAContext.h would pull in cuSPARSE headers that CPU CI boxes lack. The binding reads DeviceInfo; the kernel files
// raise a kernel's dynamic shared-memory limit and read its occupancy through the templates below (instantiated in
// .cu files only).
#pragma once

#include <cuda_runtime.h>

namespace ddtree {

constexpr int kMaxDevices = 64;  // devices of one process the caches tell apart (device & 63)

struct DeviceInfo {
  int sms;                   // multiprocessors
  int smem_per_block_optin;  // opt-in shared memory a block, bytes
};

// `device`'s DeviceInfo; all zero if the driver could not be asked (then asked again on the next call).
inline const DeviceInfo& device_info(int device) {
  static DeviceInfo cache[kMaxDevices] = {};
  DeviceInfo& d = cache[device & (kMaxDevices - 1)];
  if (d.sms == 0) {
    int optin = 0, sms = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
      d.smem_per_block_optin = optin;
      d.sms = sms;
    }
  }
  return d;
}

// Raises Kernel's dynamic shared-memory limit to `smem` bytes, once per device: a function attribute, not a stream
// operation, so harmless during CUDA-graph capture (the op's first call, before any capture, sets it).
template <auto Kernel>
void ensure_dynamic_smem(int smem, int device) {
  static unsigned long long done = 0;  // a bit per device
  const unsigned long long bit = 1ull << (device & (kMaxDevices - 1));
  if (done & bit) return;
  cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  done |= bit;
}

// CTAs of Kernel (`threads` a block, `smem` bytes of dynamic shared memory) resident on one SM of `device`, at least
// 1; its shared-memory limit is raised first.
template <auto Kernel>
int max_active_ctas(int device, int threads, int smem) {
  static int cache[kMaxDevices] = {};
  int& c = cache[device & (kMaxDevices - 1)];
  if (c == 0) {
    ensure_dynamic_smem<Kernel>(smem, device);
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem) != cudaSuccess) n = 0;
    c = n > 0 ? n : 1;
  }
  return c;
}

}  // namespace ddtree
