// The one launch helper of the MLA kernels: a 64-row kernel over its (row tile, part) grid, and a kernel launched
// with or without programmatic dependent launch (the decode kernel and the wide combine).
#pragma once

#include <cuda_runtime.h>

#include "device_cache.h"
#include "params.h"

namespace ddtree {

// Launches one of the 64-row kernels: a CTA per (row tile, part) of the device scheduler's plan.
template <auto Kernel>
void launch_row_tiles(const MlaParams& p, int threads, int smem, cudaStream_t stream) {
  int device = 0;
  cudaGetDevice(&device);
  ensure_dynamic_smem<Kernel>(smem, device);
  Kernel<<<dim3(p.num_row_tiles, p.num_parts), threads, smem, stream>>>(p);
}

// kernel<<<grid, block, smem, stream>>>(p, extra...), with programmatic stream serialization when `pdl`
// (programmatic dependent launch, sm_90+: the combine's blocks, and the next call's main kernel, are launched while
// the kernel before them drains, not after it; the dispatch turns it on for sm_90+ unless VLLM_DDTREE_MLA_PDL=0).
template <typename... Extra>
void launch_kernel(void (*kernel)(const MlaParams, Extra...), dim3 grid, int threads, int smem, cudaStream_t stream,
                   bool pdl, const MlaParams& p, Extra... extra) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, p, extra...);
}

}  // namespace ddtree
