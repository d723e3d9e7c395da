// Host-side launch helpers shared by the MLA verify kernels that take more than 48 KB of dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include "mla_tree_verify.cuh"

namespace ddtree {

// Raises Kernel's dynamic shared-memory limit to `smem` bytes, once per device: a function attribute, not a stream
// operation, so harmless during CUDA-graph capture (the op's first call, before any capture, sets it).
template <auto Kernel>
void ensure_dynamic_smem(int smem, int device) {
  static unsigned long long done = 0;  // a bit per device
  const unsigned long long bit = 1ull << (device & 63);
  if (done & bit) return;
  cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  done |= bit;
}

// Launches one of the 64-row kernels: a CTA per (row tile, part) of the device scheduler's plan.
template <auto Kernel>
void launch_row_tiles(const MlaParams& p, int threads, int smem, cudaStream_t stream) {
  int device = 0;
  cudaGetDevice(&device);
  ensure_dynamic_smem<Kernel>(smem, device);
  Kernel<<<dim3(p.num_row_tiles, p.num_parts), threads, smem, stream>>>(p);
}

}  // namespace ddtree
