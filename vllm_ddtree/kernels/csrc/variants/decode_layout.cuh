// Shared-memory layout and fragment addressing of the decode kernel (variants/decode.cu), kept free of CUDA
// headers so the host harness tests/csrc/decode_frag_check.cpp checks these very expressions against the PTX
// fragment layouts (emulated ldmatrix / mma.m16n8k16) and for bank conflicts.
//
// Dims of warp w (0..3): latent 128w .. 128w+127 and rope 512+16w .. 512+16w+15, 144 of the 576. QK of warp w adds
// over these dims only (9 k-steps of 16: kk 0..7 latent, kk 8 rope); its PV covers exactly its latent dims as the
// 512 V dims. So a warp reads only the bytes it loaded itself: loads, waits and buffer reuse are warp-local.
//
// A warp's "slice" of a 16-row block (16 keys of a tile, or the CTA's 16 query rows), bf16:
//   latent: 16 rows x 256 B (16 units of 16 B = 8 dims), unit u of row r at r*256 + ((u ^ (r & 7)) << 4)
//   rope:   16 rows x 32 B (2 units), unit u of row r at 4096 + r*32 + ((u ^ ((r >> 2) & 1)) << 4)
// An ldmatrix phase reads one unit of 8 consecutive rows (r0 = 0 or 8): the XOR spreads them over the 8 16-byte
// bank groups, both parts conflict-free.
// fp8 raw slice (what cp.async writes; widened to the bf16 slice once per tile, warp-locally):
//   latent 16 rows x 128 B (unit u = dims 16u..16u+15 of the warp) at r*128 + u*16, rope 16 x 16 B at 2048 + r*16.
#pragma once

#include <cstdint>

#include "host_device.cuh"

namespace ddtree {
namespace dec {

constexpr int kRows = 16;            // query rows per CTA (one m16 tile)
constexpr int kBN = 16;              // keys per slice (a KV tile holds 1 or 2 slices: KSUB)
constexpr int kWarps = 4;
constexpr int kSliceBf = 4608;       // bf16 slice: 16 x (256 + 32) B
constexpr int kRopeOff = 4096;
constexpr int kSliceFp8 = 2304;      // fp8 raw slice: 16 x (128 + 16) B
constexpr int kRopeOffFp8 = 2048;
constexpr int kUnitsBf = 288;        // 16-byte units per bf16 slice (9 per lane)
constexpr int kUnitsFp8 = 144;       // per fp8 raw slice (4.5 per lane)
constexpr int kKSteps = 9;           // 16-dim k-steps of QK per warp
constexpr int kVTiles = 16;          // 8-dim n-tiles of PV per warp (128 latent dims)

DDTREE_HD uint32_t lat_off(int r, int u) { return r * 256 + ((u ^ (r & 7)) << 4); }
DDTREE_HD uint32_t rope_off(int r, int u) { return kRopeOff + r * 32 + ((u ^ ((r >> 2) & 1)) << 4); }
// Half h (0: dims +0..7, 1: +8..15) of k-step kk of row r.
DDTREE_HD uint32_t kstep_off(int r, int kk, int h) { return kk < 8 ? lat_off(r, 2 * kk + h) : rope_off(r, h); }

// ldmatrix lane addresses (the 4 matrices of an x4 are given by lanes 0-7, 8-15, 16-23, 24-31).
// Q as the A operand of k-step kk: matrices (rows 0-7, h 0), (rows 8-15, h 0), (rows 0-7, h 1), (rows 8-15, h 1)
// = a0, a1, a2, a3.
DDTREE_HD uint32_t qa_addr(int lane, int kk) { return kstep_off(lane & 15, kk, lane >> 4); }
// K as the B operand (non-trans, rows = keys): matrices (keys 0-7, h 0), (keys 0-7, h 1), (keys 8-15, h 0),
// (keys 8-15, h 1) = b0, b1 of the n-tile of keys 0-7, then b0, b1 of keys 8-15.
DDTREE_HD uint32_t kb_addr(int lane, int kk) { return kstep_off((lane & 7) + ((lane >> 4) << 3), kk, (lane >> 3) & 1); }
// V as the B operand of PV (.trans, rows = keys): for n-tile pair jj (latent units 2jj, 2jj+1 = dims 16jj..16jj+15
// of the warp): matrices (keys 0-7, unit 2jj), (keys 8-15, unit 2jj), (keys 0-7, unit 2jj+1), (keys 8-15, 2jj+1)
// = b0, b1 of n-tile 2jj, then b0, b1 of n-tile 2jj+1.
DDTREE_HD uint32_t vb_addr(int lane, int jj) {
  return lat_off((lane & 7) + (((lane >> 3) & 1) << 3), 2 * jj + (lane >> 4));
}

// bf16 slice unit i (0..287; lane + 32*it): its row, its offset in the slice and its first dim of the 576.
// Units 0..255 are latent (2 rows per 32 lanes), 256..287 rope (lane -> row lane/2, unit lane%2).
DDTREE_HD void bf16_unit(int i, int w, int& r, uint32_t& off, int& dim) {
  if (i < 256) {
    r = i >> 4;
    const int u = i & 15;
    off = lat_off(r, u);
    dim = 128 * w + 8 * u;
  } else {
    const int j = i - 256;
    r = j >> 1;
    const int u = j & 1;
    off = rope_off(r, u);
    dim = 512 + 16 * w + 8 * u;
  }
}

// fp8 raw slice unit i (0..143): its row, offset in the raw slice, first dim (= byte column in the cache row), and
// where its 16 widened bf16 values go (two bf16 units).
DDTREE_HD void fp8_unit(int i, int w, int& r, uint32_t& raw_off, int& dim, uint32_t& bf_off0, uint32_t& bf_off1) {
  if (i < 128) {
    r = i >> 3;
    const int u = i & 7;
    raw_off = r * 128 + u * 16;
    dim = 128 * w + 16 * u;
    bf_off0 = lat_off(r, 2 * u);
    bf_off1 = lat_off(r, 2 * u + 1);
  } else {
    r = i - 128;
    raw_off = kRopeOffFp8 + r * 16;
    dim = 512 + 16 * w;
    bf_off0 = rope_off(r, 0);
    bf_off1 = rope_off(r, 1);
  }
}

// S exchange of a tile of nk / 2 16-key slices: float offset of lane's float4 k (0 .. nk - 1: slice k / 2, n-tile
// k % 2, elements 0..3) of warp w in buffer xb. Consecutive lanes hold consecutive float4s (conflict-free).
DDTREE_HD int xs_off(int xb, int w, int k, int lane, int nk) { return (((xb * kWarps + w) * nk + k) * 32 + lane) * 4; }

// O n-tile j (0..15), accumulator e (0..3) of lane (g = lane>>2, q4 = lane&3) in warp w: row g + 8*(e>>1), dim:
DDTREE_HD int o_dim(int w, int j, int q4, int e) { return 128 * w + 8 * j + 2 * q4 + (e & 1); }

}  // namespace dec
}  // namespace ddtree
