// The host entry point of each kernel file, which the binding (api/bindings.cpp) calls in launch order: for the
// 64-row kernels the scheduler, the main kernel, the row-tile combine; for the decode kernel the kernel (it plans in
// its own CTAs), then the wide combine. Free of torch headers and of CUDA syntax, so the binding includes it.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace ddtree {

// scheduling/sched_kernel.cu: the 64-row kernels' split plan, computed on the device (one block).
void launch_mla_sched(const MlaParams& p, cudaStream_t stream);

// variants/resident_v.cu: the resident-V main kernel (sm_90).
void launch_mla_resident_v(const MlaParams& p, cudaStream_t stream);

// variants/portable.cu: the portable main kernel (<= 99 KB of shared memory a block).
void launch_mla_portable(const MlaParams& p, cudaStream_t stream);

// variants/decode.cu: CTAs of the decode kernel that fit one SM of `device` (occupancy of its deep or shallow
// configuration, cached); the binding sizes num_parts = this (or the launch's decode_ctas_per_sm) x SMs / row tiles.
int mla_decode_ctas_per_sm(int device, bool fp8, bool deep);
// variants/decode.cu: the decode kernel (each CTA plans its own part); `deep`: the 32-key-tile configuration, else
// the shallow one; `pdl`: programmatic dependent launch (sm_90+).
void launch_mla_decode(const MlaParams& p, bool deep, bool pdl, cudaStream_t stream);

// combine/combine.cu: merges the 64-row kernels' fp32 split partials (pieces of a SchedView).
void launch_mla_combine(const MlaParams& p, cudaStream_t stream);
// combine/combine.cu: merges the decode kernel's bf16 split partials (counts of a DecodeSplitView), `pdl` as above.
void launch_mla_combine_wide(const MlaParams& p, bool pdl, cudaStream_t stream);

}  // namespace ddtree
