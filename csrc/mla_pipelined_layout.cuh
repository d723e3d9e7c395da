// Shared-memory layout and fragment addressing of the portable pipelined kernel (mla_tree_verify_pipelined.cu), kept
// free of CUDA headers so the host harness tests/csrc/pipelined_frag_check.cpp checks these very expressions against
// the PTX fragment layouts (emulated ldmatrix / mma.m16n8k16), for coverage and for bank conflicts.
//
// A ring stage holds one 16-key tile as 9 swizzled [16 keys x 64 dims] bf16 chunks (dims 64j .. 64j + 63 in chunk j,
// rope = chunk 8): 16-byte unit u (dims 8u .. 8u + 7 of the 576) of key r at kv_off(r, u). Q's rope dims of the 64
// rows are one swizzled [64 x 64] chunk; P of a tile is [64 rows x 16 keys] bf16 with rows kPStride elements apart.
#pragma once

#include <cstdint>

#include "host_device.cuh"

namespace ddtree {
namespace pipe {

constexpr int kBN = 16;               // keys a tile
constexpr int kRows = 64;             // packed rows a CTA
constexpr int kChunk = kBN * 128;     // one [16 x 64] bf16 chunk
constexpr int kTile = 9 * kChunk;     // a ring stage
constexpr int kPStride = kBN + 8;     // bf16 a P row: conflict-free stores and ldmatrix
constexpr int kUnits = 72;            // 16-byte units a key (576 bf16)
constexpr int kLoadIters = 5;         // units a loader thread issues (the last one for half of them)
constexpr int kQkSteps = 18;          // k-steps of QK a warp (its parity's half of 36)

// 16-byte unit u (0..63) of row r in a [rows x 64] bf16 chunk of 128-byte rows, swizzled with the row's low bits.
DDTREE_HD uint32_t swz128(int r, int u) { return r * 128 + ((u ^ (r & 7)) << 4); }
// Unit u (0..71) of key r in a ring stage.
DDTREE_HD uint32_t kv_off(int r, int u) { return (u >> 3) * kChunk + swz128(r, u & 7); }

// Loader: thread tid (0..255) copies key tid / 16, units tid % 16 + 16 k (k < kLoadIters, unit < 72); unit + 16 is
// two chunks further (the kernel adds 2 k kChunk to one address).
DDTREE_HD int load_key(int tid) { return tid >> 4; }
DDTREE_HD int load_unit(int tid, int k) { return (tid & 15) + 16 * k; }

// QK of warp (row group g, k-step parity c), step i (0..17): k-step 2i + c of the latent dims (i < 16, Q from
// registers) or 32 + 2(i - 16) + c of the rope dims (Q from the rope chunk).
DDTREE_HD int qk_kstep(int i, int c) { return i < 16 ? 2 * i + c : 32 + 2 * (i - 16) + c; }
// K as the B operand (non-trans, rows = keys) of step i: matrices (keys 0-7, dims lo), (keys 0-7, hi), (keys 8-15,
// lo), (keys 8-15, hi) = b0, b1 of the n-tile of keys 0-7, then of keys 8-15. k-step k is chunk k / 4, units
// 2 (k % 4) and 2 (k % 4) + 1, so step i is chunk i >> 1 and its unit differs from step 0's by an XOR: one lane
// offset (qk_kofs) and a constant serve every step.
DDTREE_HD uint32_t qk_kofs(int lane, int c) {
  const int key = (lane & 7) + ((lane >> 4) << 3);
  return (key * 128 + ((((lane >> 3) & 1) ^ (lane & 7)) << 4)) ^ (c << 5);
}
DDTREE_HD uint32_t qk_b_addr(int lane, int c, int i) { return (i >> 1) * kChunk + (qk_kofs(lane, c) ^ ((i & 1) << 6)); }
// Q's rope dims as the A operand of step i (16, 17) of row group g: matrices (rows 0-7, lo), (rows 8-15, lo),
// (rows 0-7, hi), (rows 8-15, hi) = a0..a3.
DDTREE_HD uint32_t rope_a_addr(int lane, int g, int c, int i) {
  return swz128(16 * g + (lane & 15), 2 * (2 * (i - 16) + c) + (lane >> 4));
}

// P: byte offset of element (row, key) in a P buffer, and the A-operand lane address of m-tile mi (rows 16 mi..).
DDTREE_HD uint32_t p_off(int row, int key) { return (row * kPStride + key) * 2; }
DDTREE_HD uint32_t p_a_addr(int lane, int mi) { return (mi * 16 + (lane & 15)) * (kPStride * 2) + ((lane >> 4) << 4); }

// V as the B operand of PV (.trans, rows = keys) for warp w (dims 64w .. 64w + 63 = chunk w) and n-tile pair jj:
// matrices (keys 0-7, unit 2jj), (keys 8-15, 2jj), (keys 0-7, 2jj + 1), (keys 8-15, 2jj + 1) = b0, b1 of n-tile
// 2jj, then of 2jj + 1.
DDTREE_HD uint32_t v_b_addr(int lane, int w, int jj) {
  return w * kChunk + swz128((lane & 7) + (((lane >> 3) & 1) << 3), 2 * jj + (lane >> 4));
}

}  // namespace pipe
}  // namespace ddtree
