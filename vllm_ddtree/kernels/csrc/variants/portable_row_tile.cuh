// Row-tile pieces of the portable 64-row kernel (variants/portable.cu), apart from its tile loop: Q loads,
// the pair exchange, tree mask and online softmax, and the epilogue. Its layout: 8 warps, warp (row group
// g = warp & 3, k-step parity c = warp >> 2) holding Q's latent k-steps 2i + c of its 16 rows in registers, Q's rope
// dims in one swizzled [64 x 64] chunk of shared memory, and warp w owning O[64 rows x dims 64w .. 64w + 63].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>

#include "device_utils.cuh"
#include "params.h"

namespace ddtree {
namespace row_tile {

using namespace dev;  // device_utils.cuh

__device__ __forceinline__ void pair_barrier(int id) {  // the two warps of a row group (64 threads)
  asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// One 32-bit pair of Q elements as bf16 (fp16 queries are converted; rows past the request are zero).
__device__ __forceinline__ uint32_t q_pair(const uint16_t* src, bool valid, bool fp16) {
  if (!valid) return 0u;
  const uint32_t raw = __ldg(reinterpret_cast<const unsigned int*>(src));
  if (!fp16) return raw;
  __half2 h;
  memcpy(&h, &raw, 4);
  const float2 f = __half22float2(h);
  return pack_bf16(f.x, f.y);
}

// The pair's halves of S summed: parity c keeps rows g8 + 8c (accumulator elements 2c, 2c + 1) of each of the NT
// 8-key n-tiles and hands the other two to its partner through ex ([row group][giver][2 NT values][lane] fp32).
template <int NT>
__device__ __forceinline__ void pair_sum(const float (&s)[NT][4], float (&sk)[NT][2], float* ex, int g, int c,
                                         int lane) {
  float* give = ex + (g * 2 + c) * 2 * NT * 32 + lane;
  const float* take = ex + (g * 2 + (c ^ 1)) * 2 * NT * 32 + lane;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    give[(2 * j) * 32] = c ? s[j][0] : s[j][2];
    give[(2 * j + 1) * 32] = c ? s[j][1] : s[j][3];
  }
  pair_barrier(1 + g);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    sk[j][0] = (c ? s[j][2] : s[j][0]) + take[(2 * j) * 32];
    sk[j][1] = (c ? s[j][3] : s[j][1]) + take[(2 * j + 1) * 32];
  }
}

// The tree mask of (tile-global) row `row` over this thread's keys key0 + 8 j + 2 q4 + e, for a tile that reaches the
// tree keys [tree_start, L): keys past L and tree keys the row's tree_bits word leaves out become -inf.
template <int NT>
__device__ __forceinline__ void tree_mask(float (&sk)[NT][2], const MlaParams& p, int key0, int L, int tree_start,
                                          int row, int rows, int q0, int q4) {
  const uint64_t bits = row < rows ? static_cast<uint64_t>(p.tree_bits[q0 + row / p.H]) : ~0ull;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = key0 + j * 8 + 2 * q4 + e;
      const int tk = key - tree_start;
      const bool vis = key < L && (tk < 0 || ((bits >> tk) & 1ull));
      sk[j][e] = vis ? sk[j][e] : -INFINITY;
    }
}

// Online softmax of one row over this thread's NT x 2 scores of a tile (its quad holds the rest), in log2 units with
// lazy rescaling: the reference max m moves only when the tile's max exceeds it by more than kRescaleSlack (P <=
// 2^kRescaleSlack, so most tiles leave O alone; the scale is positive, so it commutes with the max). Updates m and the
// thread's partial sum l, writes the tile's alpha (lane q4 == 0) and the row's P as bf16 at prow.
template <int NT>
__device__ __forceinline__ void online_softmax(const float (&sk)[NT][2], float& m, float& l, float scale_log2,
                                               float* alpha_dst, __nv_bfloat16* prow, int q4) {
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(sk[j][0], sk[j][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mt = mx * scale_log2;
  float alpha = 1.f;
  if (mt > m + kRescaleSlack) {  // false while mt = -inf; true for the first finite max (m = -inf)
    alpha = fast_exp2(m - mt);
    m = mt;
    l *= alpha;
  }
  const float muse = m == -INFINITY ? 0.f : m;  // fully masked so far: keep exp2 finite
  if (q4 == 0) *alpha_dst = alpha;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float p0 = fast_exp2(fmaf(sk[j][0], scale_log2, -muse));
    const float p1 = fast_exp2(fmaf(sk[j][1], scale_log2, -muse));
    l += p0 + p1;
    *reinterpret_cast<uint32_t*>(prow + j * 8 + 2 * q4) = pack_bf16(p0, p1);
  }
}

// Q's rope dims of the tile's 64 rows -> the swizzled chunk at sQpe (bf16 through cp.async, joining the caller's next
// group; fp16 converted on the way); rows past the request are zero.
template <int kThreads>
__device__ __forceinline__ void load_q_rope(const MlaParams& p, uint32_t sQpe, int tid, int rt, int rows, int q0) {
#pragma unroll
  for (int it = 0; it < kBM * 8 / kThreads; ++it) {
    const int i = tid + it * kThreads, r = i >> 3, u = i & 7;
    const int row = rt * kBM + r;
    const bool valid = row < rows;
    const int64_t tok = q0 + (valid ? row / p.H : 0);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.q_pe) +
                         (tok * p.q_pe_s0 + (valid ? row % p.H : 0) * p.q_pe_s1 + u * 8) * 2;
    if (!p.q_fp16) {
      cp_async16(sQpe + swz(r, u), src, valid);
    } else {
      sts128(sQpe + swz(r, u), valid ? half8_to_bf16(*reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0));
    }
  }
}

// A fragments (m16n8k16) of the latent k-steps 2i + c of rows row0 (+8), row0 = rt * kBM + 16 g + lane / 4.
__device__ __forceinline__ void load_q_latent(const MlaParams& p, uint32_t (&qa)[16][4], int row0, int rows, int q0,
                                              int c, int q4) {
  const uint16_t* nope[2];
  bool valid[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int row = row0 + 8 * e;
    valid[e] = row < rows;
    const int64_t tok = q0 + (valid[e] ? row / p.H : 0);
    const int head = valid[e] ? row % p.H : 0;
    nope[e] = reinterpret_cast<const uint16_t*>(p.q_nope) + tok * p.q_nope_s0 + head * p.q_nope_s1;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      qa[i][e] = q_pair(nope[e & 1] + 32 * i + 16 * c + 2 * q4 + (e >> 1) * 8, valid[e & 1], p.q_fp16);
}

// The owner lane of CTA-local row lr (sum l over the row, reference max m in log2 units) writes kv_scale / l to
// inv[lr] and the row's lse: natural log into p.lse for a request in one piece, base 2 into the workspace otherwise.
__device__ __forceinline__ void store_row_stats(const MlaParams& p, float* inv, int lr, int rt, int rows, int q0,
                                                int slot, float m, float l) {
  inv[lr] = l > 0.f ? p.kv_scale / l : 0.f;
  const int row = rt * kBM + lr;
  if (row < rows) {
    const float lse2 = l > 0.f ? m + log2f(l) : -INFINITY;
    if (slot < 0) {
      p.lse[(q0 + row / p.H) * p.lse_s0 + (row % p.H) * p.lse_s1] = lse2 * kLn2;
    } else {
      p.ws_lse[(int64_t)slot * (p.max_q * p.H) + row] = lse2;
    }
  }
}

// Warp w's O block, normalized by inv[row]: into p.out, or as fp32 partials into the workspace slot of a split piece.
__device__ __forceinline__ void write_o_block(const MlaParams& p, const float (&o)[4][8][4], const float* inv,
                                              int warp, int lane, int rt, int rows, int q0, int slot) {
  const int g8 = lane >> 2, q4 = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int eh = 0; eh < 2; ++eh) {
      const int orl = mi * 16 + g8 + 8 * eh;
      const int row = rt * kBM + orl;
      if (row >= rows) continue;
      const float s = inv[orl];
      if (slot < 0) {
        const int64_t tok = q0 + row / p.H;
        char* orow = reinterpret_cast<char*>(p.out) + (tok * p.out_s0 + (row % p.H) * p.out_s1) * 2;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int d = warp * 64 + nt * 8 + 2 * q4;
          *reinterpret_cast<uint32_t*>(orow + d * 2) = pack_out(o[mi][nt][2 * eh] * s, o[mi][nt][2 * eh + 1] * s,
                                                                p.out_fp16);
        }
      } else {
        float* wrow = p.ws_o + ((int64_t)slot * (p.max_q * p.H) + row) * kDV;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int d = warp * 64 + nt * 8 + 2 * q4;
          *reinterpret_cast<float2*>(wrow + d) = make_float2(o[mi][nt][2 * eh] * s, o[mi][nt][2 * eh + 1] * s);
        }
      }
    }
}

// O = 0 before a piece's first tile.
__device__ __forceinline__ void zero_o(float (&o)[4][8][4]) {
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][nt][e] = 0.f;
}

// O *= alpha of its rows (alpha: the tile's per-row factors, CTA-local), skipped when no row of the warp moved.
__device__ __forceinline__ void rescale_o(float (&o)[4][8][4], const float* alpha, int lane) {
  const int g8 = lane >> 2;
  float a[4][2];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
    a[mi][0] = alpha[mi * 16 + g8];
    a[mi][1] = alpha[mi * 16 + g8 + 8];
  }
  bool moved = false;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) moved |= a[mi][0] != 1.f || a[mi][1] != 1.f;
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        o[mi][nt][0] *= a[mi][0];
        o[mi][nt][1] *= a[mi][0];
        o[mi][nt][2] *= a[mi][1];
        o[mi][nt][3] *= a[mi][1];
      }
  }
}

}  // namespace row_tile
}  // namespace ddtree
