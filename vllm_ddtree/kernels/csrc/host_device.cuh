// DDTREE_HD: functions that the kernels call on the device and the host harnesses under tests/csrc/ call on the CPU
// (built there by a plain C++ compiler, without CUDA headers), so both run the very same expressions.
#pragma once

#ifdef __CUDACC__
#define DDTREE_HD __host__ __device__ __forceinline__
#else
#define DDTREE_HD inline
#endif
