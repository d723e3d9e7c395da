// MLA tree-verify attention, portable path: mma.sync and <= 99 KB of shared memory per block, so one source serves
// sm_80 / sm_86 / sm_89 / sm_120 (and runs on the H200 for correctness).
//
// Why this shape: with mma.sync every warp reads its operands from shared memory, and at MLA's 576-dim keys that
// traffic bounds the kernel. Keeping Q (64 rows x 576 bf16 = 72 KB) in shared memory left room for a ring of a few
// 64-dim chunks only, so V had to be fetched a second time and QK read Q and K per warp (the first portable kernel,
// docs/results.md section 6.1). Here Q lives in registers, split over a warp pair by k-step parity, so shared
// memory holds two whole KV tiles (V is read from the K tile already there) and QK reads K only.
//
// One CTA: 64 packed rows r = node*H + head of one request, 8 warps, KV tiles of 32 tokens, double-buffered.
// - QK: warp (row group g = warp & 3, k-step parity c = warp >> 2) holds Q[16 rows of g, its 16 latent k-steps
//   2i + c] in 64 registers (the 4 rope k-steps come from shared memory: the registers would spill) and adds
//   S[16 x 32] over its k-steps; the pair swaps row halves through shared memory, so each thread ends with one row's
//   full S (row 16g + 8c + lane/4, 8 of the 32 keys) and its quad does that row's softmax.
// - PV: warp w owns O[64 rows x dims 64w .. 64w+63] (128 registers): P from shared memory, V = chunk w of the tile.
// - Loads: cp.async, 8 threads a token row, one address register with immediate offsets; the next tile is issued at
//   the start of this one (fp8 tiles spread their cp.async over the QK steps).
// Split-KV pieces come from the device scheduler (scheduling/sched_kernel.cu); a split request writes normalized fp32
// partials and base-2 lse for the row-tile combine (combine/combine.cu), like the resident-V kernel
// (variants/resident_v.cu).
#include <cuda_bf16.h>

#include <cmath>

#include "device_utils.cuh"
#include "entry_points.h"
#include "launch.cuh"
#include "params.h"
#include "scheduling/plan_piece.cuh"
#include "variants/portable_row_tile.cuh"

namespace ddtree {
namespace {

using namespace dev;  // device_utils.cuh

template <bool FP8>
struct PortableCfg {
  static constexpr int kBN = 32;  // tokens per KV tile (the scheduler's block_n for this variant)
  static constexpr int kThreads = 256;
  static constexpr int kChunk = kBN * 128;                      // one swizzled [32 x 64] bf16 chunk
  static constexpr int kTile = 9 * kChunk;                      // a bf16 tile: 9 chunks, 36 KB
  static constexpr int kRawTile = FP8 ? kBN * kDQK : kTile;     // fp8 tiles land as [32 x 576] bytes
  static constexpr int kOffConv = 2 * kRawTile;                 // fp8: the current tile widened to bf16
  static constexpr int kOffP = kOffConv + (FP8 ? kTile : 0);
  static constexpr int kPStride = kBN + 8;                      // bf16 per sP row: conflict-free stores and ldmatrix
  static constexpr int kOffEx = kOffP + kBM * kPStride * 2;
  static constexpr int kExBytes = 4 * 2 * 8 * 32 * 4;           // [row group][giver][8 values][lane] fp32
  static constexpr int kOffQpe = kOffEx + kExBytes;             // Q's rope dims: a swizzled [64 x 64] bf16 chunk
  static constexpr int kOffRow = kOffQpe + kBM * 128;           // [64] alpha of the tile, then kv_scale / l
  static constexpr int kSmem = kOffRow + kBM * 4;
  static_assert(kSmem <= 101376, "portable path must fit sm_120's 99 KB per block");
  static constexpr int kUnitsPerRow = FP8 ? 36 : 72;            // 16-byte units per token
  static constexpr int kLoadIters = (kUnitsPerRow + 7) / 8;     // 8 threads per token
};
static_assert(PortableCfg<false>::kBN == mla_variant_block_n(kVariantPortable) &&
                  PortableCfg<true>::kBN == mla_variant_block_n(kVariantPortable),
              "the scheduler plans in this kernel's KV tiles");

template <bool FP8>
__global__ void __launch_bounds__(256, 1) mla_tree_verify_portable_kernel(const MlaParams p) {
  using C = PortableCfg<FP8>;
  constexpr int BN = C::kBN;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = warp & 3, c = warp >> 2;  // QK: row group, k-step parity
  const int g8 = lane >> 2, q4 = lane & 3;
  const int lr = 16 * g + 8 * c + g8;  // the CTA-local row whose softmax this thread's quad keeps
  const int rt = blockIdx.x, part = blockIdx.y;

  const uint32_t sRing = smem_u32(smem);
  const uint32_t sConv = smem_u32(smem + C::kOffConv);
  const uint32_t sPu = smem_u32(smem + C::kOffP);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + C::kOffP);
  float* ex = reinterpret_cast<float*>(smem + C::kOffEx);
  float* srow = reinterpret_cast<float*>(smem + C::kOffRow);
  const uint32_t sQpe = smem_u32(smem + C::kOffQpe);

  // QK operand offsets: k-step 2i + c of key n-tile pair jj is chunk i/2, 16-byte unit ((i&1) << 2 | c << 1 | hi),
  // swizzled with the key's low bits; only i's parity changes the unit, so two offsets serve every step.
  const int qk_key = (lane & 7) + ((lane >> 4) << 3);
  const int qk_x = ((c << 1) | ((lane >> 3) & 1)) ^ (lane & 7);
  const uint32_t qk_off_even = qk_key * 128 + (qk_x << 4), qk_off_odd = qk_key * 128 + ((qk_x ^ 4) << 4);
  // loader: token lrow of a tile, 16-byte units u0 + 8k
  const int lrow = tid >> 3, u0 = tid & 7;

  SchedView sv(p.sched, p.B, p.num_parts);
  const int pc_begin = sv.part_begin[part], pc_end = sv.part_begin[part + 1];
  const int page_mask = (1 << p.page_log2) - 1;

  for (int pc = pc_begin; pc < pc_end; ++pc) {
    PlanPiece pz;
    if (!read_plan_piece(p, sv, pc, rt * kBM, pz)) continue;  // uniform across the CTA
    const int q0 = pz.q0, rows = pz.rows, L = pz.L, tree_start = pz.tree_start;
    const int t0 = pz.t0, t1 = pz.t1, slot = pz.slot;
    const int* bt = pz.bt;
    const bool qk_work = 16 * g < rows - rt * kBM;  // warp-uniform: a row group past the request skips its mma

    auto page_of = [&](int tile) {
      const int tok = tile * BN + lrow;
      return tok < L ? bt[tok >> p.page_log2] : 0;
    };
    // A tile's loads: this thread's token row (tokens past L zero-filled: never read) and its k-th 16-byte unit.
    struct TileRow {
      const uint8_t* src;
      uint32_t dst;
      bool ok;
    };
    auto tile_row = [&](int tile, int page, uint32_t stage) {
      const int tok = tile * BN + lrow;
      const bool ok = tok < L;
      const uint8_t* src = ok ? p.kv + (int64_t)page * p.kv_page_stride + (int64_t)(tok & page_mask) * p.kv_row_stride
                              : p.kv;
      return TileRow{src, FP8 ? stage + lrow * kDQK + u0 * 16 : stage + swz(lrow, u0), ok};
    };
    auto load_unit = [&](const TileRow& tr, int k) {  // src + constant: one address register, immediate offsets
      if (u0 + 8 * k < C::kUnitsPerRow) {
        cp_async16(tr.dst + (FP8 ? 128 * k : k * C::kChunk), tr.src + (u0 + 8 * k) * 16, tr.ok);
      }
    };
    auto issue_tile = [&](int tile, int page, uint32_t stage) {  // one cp.async group
      const TileRow tr = tile_row(tile, page, stage);
#pragma unroll
      for (int k = 0; k < C::kLoadIters; ++k) load_unit(tr, k);
      cp_async_commit();
    };

    __syncthreads();  // the previous piece is done with every buffer
    row_tile::load_q_rope<C::kThreads>(p, sQpe, tid, rt, rows, q0);  // joins tile t0's cp.async group
    if (t0 < t1) issue_tile(t0, page_of(t0), sRing);
    int next_page = t0 + 1 < t1 ? page_of(t0 + 1) : 0;

    uint32_t qa[16][4];  // Q fragments of this warp's 16 rows and latent k-steps 2i + c
    row_tile::load_q_latent(p, qa, rt * kBM + 16 * g + g8, rows, q0, c, q4);

    float m = -INFINITY, l = 0.f;  // row lr: reference max (log2 units, scaled) and this thread's partial sum
    float o[4][8][4];               // O[rows mi*16 + g8 (+8), dims 64 warp + nt*8 + 2q4 (+1)]
    row_tile::zero_o(o);

    for (int tile = t0; tile < t1; ++tile) {
      const uint32_t stage = sRing + ((tile - t0) & 1) * C::kRawTile;
      cp_async_wait<0>();
      __syncthreads();  // this tile is in shared memory; every warp is done with the last tile's buffers
      // The next tile streams in while this one is computed. fp8 tiles spread their 5 cp.async a thread over the QK
      // steps, where they fill issue slots the mma chains leave free (a warp without QK work issues them at once);
      // bf16 tiles issue their 9 here, where spreading them costs (measured: docs/results.md, section 6.1).
      const bool has_next = tile + 1 < t1;
      const TileRow next_row = tile_row(tile + 1, next_page, sRing + ((tile + 1 - t0) & 1) * C::kRawTile);
      if (tile + 2 < t1) next_page = page_of(tile + 2);
      if (has_next && (!FP8 || !qk_work)) {
#pragma unroll
        for (int k = 0; k < C::kLoadIters; ++k) load_unit(next_row, k);
      }
      uint32_t kv = stage;
      if constexpr (FP8) {  // widen once, for all warps
        constexpr int kWidenIters = (BN * 36 + C::kThreads - 1) / C::kThreads;
#pragma unroll 1
        for (int it = 0; it < kWidenIters; ++it) {
          const int i = tid + it * C::kThreads;
          if (i < BN * 36) {
            const int r = i / 36, u = i % 36;
            uint4 w[2];
            fp8x16_to_bf16(lds128(stage + r * kDQK + u * 16), w);
            sts128(sConv + (u >> 2) * C::kChunk + swz(r, (u & 3) * 2), w[0]);
            sts128(sConv + (u >> 2) * C::kChunk + swz(r, (u & 3) * 2 + 1), w[1]);
          }
        }
        __syncthreads();
        kv = sConv;
      }

      // ---- S[16 rows of g x 32 keys] over k-steps 2i + c
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
      if (qk_work) {
#pragma unroll
        for (int i = 0; i < 18; ++i) {
          const uint32_t kb = kv + (i >> 1) * C::kChunk + ((i & 1) ? qk_off_odd : qk_off_even);
          uint32_t qpe[4];
          if (i >= 16) ldsm_x4(qpe, sQpe + swz(16 * g + (lane & 15), 2 * (2 * (i - 16) + c) + (lane >> 4)));
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            uint32_t bq[4];
            ldsm_x4(bq, kb + jj * 16 * 128);
            mma_bf16(s[2 * jj], i < 16 ? qa[i] : qpe, bq[0], bq[1]);
            mma_bf16(s[2 * jj + 1], i < 16 ? qa[i] : qpe, bq[2], bq[3]);
          }
          if (FP8 && i < C::kLoadIters && has_next) load_unit(next_row, i);
        }
      }
      cp_async_commit();  // the next tile's group (empty on the last tile)
      // ---- the pair's halves summed, the tree mask only on tiles that reach the tree keys, the online softmax of row
      // lr (log2 units): P and alpha for all warps
      float sk[4][2];
      row_tile::pair_sum<4>(s, sk, ex, g, c, lane);
      if ((tile + 1) * BN > tree_start) {  // one block the other tiles branch over
        row_tile::tree_mask<4>(sk, p, tile * BN, L, tree_start, rt * kBM + lr, rows, q0, q4);
      }
      row_tile::online_softmax<4>(sk, m, l, p.scale_log2, srow + lr, sP + lr * C::kPStride, q4);
      __syncthreads();  // sP and alpha of all 64 rows are written

      // ---- O[64 rows x dims 64 warp ..] = alpha O + P V_warp
      row_tile::rescale_o(o, srow, lane);
      const uint32_t vb = kv + warp * C::kChunk;
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        const int key = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        uint32_t bv[4][4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) ldsm_x4_t(bv[jj], vb + swz(key, jj * 2 + (lane >> 4)));
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          uint32_t pa[4];
          ldsm_x4(pa, sPu + (mi * 16 + (lane & 15)) * (C::kPStride * 2) + ((ks * 2 + (lane >> 4)) << 4));
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            mma_bf16(o[mi][2 * jj], pa, bv[jj][0], bv[jj][1]);
            mma_bf16(o[mi][2 * jj + 1], pa, bv[jj][2], bv[jj][3]);
          }
        }
      }
    }

    // ---- epilogue: the quad's sum is row lr's full sum; its owner writes lse and kv_scale / l, then every warp
    // normalizes and writes its O block
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    cp_async_wait<0>();  // a piece without tiles still issued its sQpe loads
    __syncthreads();  // the last tile's readers of srow are done
    if (q4 == 0) row_tile::store_row_stats(p, srow, lr, rt, rows, q0, slot, m, l);
    __syncthreads();
    row_tile::write_o_block(p, o, srow, warp, lane, rt, rows, q0, slot);
  }
}

template <bool FP8>
void launch_portable(const MlaParams& p, cudaStream_t stream) {
  using C = PortableCfg<FP8>;
  launch_row_tiles<mla_tree_verify_portable_kernel<FP8>>(p, C::kThreads, C::kSmem, stream);
}

}  // namespace

void launch_mla_portable(const MlaParams& p, cudaStream_t stream) {
  if (p.kv_fp8) {
    launch_portable<true>(p, stream);
  } else {
    launch_portable<false>(p, stream);
  }
}

}  // namespace ddtree
