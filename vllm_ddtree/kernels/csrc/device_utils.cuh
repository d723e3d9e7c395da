// Device helpers shared by the MLA kernels (variants/resident_v.cu, variants/decode.cu): cp.async, ldmatrix,
// mma.sync m16n8k16 bf16, exp2, bf16 packing, the 128-byte XOR swizzle and the e4m3 -> bf16 widening.
// Only instructions that exist on sm_80, sm_90 and sm_120 (no wgmma / TMA / tcgen05).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace ddtree {
namespace dev {

constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int sz = valid ? 16 : 0;  // zero-fill tokens past the end: never read them
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// x4: lanes 8i..8i+7 give the 8 row addresses of matrix i; register i holds matrix i, thread t getting row t/4,
// elements 2(t%4), 2(t%4)+1. _t (.trans): thread t gets rows 2(t%4), 2(t%4)+1 of column t/4 instead.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// D[16x8] += A[16x16] B[16x8], fp32 accumulate. Fragments (g = lane>>2, q4 = lane&3):
// A: a0 (row g, k 2q4..+1), a1 (row g+8, same k), a2 (row g, k 2q4+8..+9), a3 (row g+8, k 2q4+8..+9);
// B: b0 (k 2q4..+1, col g), b1 (k 2q4+8..+9, col g); C/D: d0,d1 (row g, cols 2q4, 2q4+1), d2,d3 (row g+8, same).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the SFU; exact enough for softmax and maps -inf to +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

// Four bf16 (two pack_bf16 pairs, low half first) back to fp32: a bf16 is the top half of its fp32.
__device__ __forceinline__ float4 unpack_bf16x4(uint2 v) {
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}

// Two fp32 values as one 4-byte pair of the output's dtype (fp16 or bf16).
__device__ __forceinline__ uint32_t pack_out(float a, float b, bool fp16) {
  if (!fp16) return pack_bf16(a, b);
  __half2 h = __floats2half2_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, 4);
  return r;
}

// Byte offset of 16-byte unit u of row r in a [rows x 128 B] swizzled chunk.
__device__ __forceinline__ uint32_t swz(int r, int u) { return r * 128 + ((u ^ (r & 7)) << 4); }

// e4m3 -> bf16 is exact; 16 bytes in, 32 bytes out.
__device__ __forceinline__ void fp8x16_to_bf16(const uint4 in, uint4 (&outv)[2]) {
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&in);
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
    __half2 hh;
    memcpy(&hh, &h, 4);
    const float2 f = __half22float2(hh);
    w[i] = pack_bf16(f.x, f.y);
  }
  outv[0] = make_uint4(w[0], w[1], w[2], w[3]);
  outv[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// 8 fp16 values (16 bytes) -> 8 bf16 values (q rows given in fp16 are staged as bf16).
__device__ __forceinline__ uint4 half8_to_bf16(const uint4 h) {
  const __half2* hh = reinterpret_cast<const __half2*>(&h);
  const float2 f0 = __half22float2(hh[0]), f1 = __half22float2(hh[1]);
  const float2 f2 = __half22float2(hh[2]), f3 = __half22float2(hh[3]);
  return make_uint4(pack_bf16(f0.x, f0.y), pack_bf16(f1.x, f1.y), pack_bf16(f2.x, f2.y), pack_bf16(f3.x, f3.y));
}

// Programmatic dependent launch (sm_90+; no-ops before): a kernel launched with programmatic stream serialization
// may start while its predecessor drains, so it must wait for it (grid_dep_wait: the predecessor complete and its
// writes visible) before touching memory the predecessor reads or writes; grid_dep_launch lets its own dependent
// start launching early.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace dev
}  // namespace ddtree
