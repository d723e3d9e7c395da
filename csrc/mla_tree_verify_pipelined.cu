// MLA tree-verify attention, portable pipelined variant (DDTREE_MLA_VARIANT=portable-pipelined; bf16 caches, fp8
// ones take the portable kernel): the portable kernel's layout (mla_tree_verify_portable.cu: 8 warps, Q's latent
// k-steps in registers split by parity over warp pairs, PV warp w owning dims 64w..64w+63, <= 99 KB of shared memory)
// with 16-key tiles in a 4-stage ring, where each warp issues tile i+1's QK mma right before tile i's PV mma and then
// exchanges and softmaxes tile i+1's scores while the tensor pipe still drains PV: one CTA barrier a tile.
//
// Why: an SM sub-partition reaches its mma.sync peak only with ~4 independent accumulator chains in flight (H200,
// bench/mma_sync_rate.cu: 7.4 cycles an mma at >= 4 chains, 26.6 for a dependent one), and the portable kernel runs
// its tile as QK, then the softmax with the tensor pipe idle, then PV (42-46 % of its mma.sync floor). Not yet run on
// a GPU: auto never picks it; the GPU tests cover it through the variant fixture.
#include <cuda_bf16.h>

#include <cmath>

#include "mla_device_utils.cuh"
#include "mla_launch.cuh"
#include "mla_pipelined_layout.cuh"
#include "mla_row_tile.cuh"
#include "mla_tree_verify.cuh"

namespace ddtree {
namespace {

using namespace dev;  // mla_device_utils.cuh

struct PipeCfg {  // the layout's constants: mla_pipelined_layout.cuh (checked on the CPU by a host harness)
  static constexpr int kBN = pipe::kBN;  // keys a tile (half of the scheduler's 32-token tile)
  static constexpr int kStages = 4;
  static constexpr int kThreads = 256;
  static constexpr int kChunk = pipe::kChunk;
  static constexpr int kTile = pipe::kTile;
  static constexpr int kPStride = pipe::kPStride;
  static constexpr int kPBuf = kBM * kPStride * 2;
  static constexpr int kOffP = kStages * kTile;  // P of tiles i and i+1
  static constexpr int kOffEx = kOffP + 2 * kPBuf;  // [row group][giver][4 values][lane] fp32
  static constexpr int kOffQpe = kOffEx + 4 * 2 * 4 * 32 * 4;  // Q's rope dims: a swizzled [64 x 64] bf16 chunk
  static constexpr int kOffAlpha = kOffQpe + kBM * 128;  // [2][64] alpha of tiles i and i+1
  static constexpr int kOffInv = kOffAlpha + 2 * kBM * 4;  // [64] kv_scale / l
  static constexpr int kSmem = kOffInv + kBM * 4;
  static_assert(kSmem <= 101376, "portable path must fit sm_120's 99 KB per block");
};
static_assert(pipe::kRows == kBM, "the layout's row tile is the kernels' kBM");

__global__ void __launch_bounds__(256, 1) mla_tree_verify_pipelined_kernel(const MlaParams p) {
  using C = PipeCfg;
  constexpr int BN = C::kBN;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = warp & 3, c = warp >> 2;  // QK: row group, k-step parity
  const int g8 = lane >> 2, q4 = lane & 3;
  const int lr = 16 * g + 8 * c + g8;  // the CTA-local row whose softmax this thread's quad keeps
  const int rt = blockIdx.x, part = blockIdx.y;

  const uint32_t sRing = smem_u32(smem), sPu = smem_u32(smem + C::kOffP), sQpe = smem_u32(smem + C::kOffQpe);
  float* ex = reinterpret_cast<float*>(smem + C::kOffEx);
  float* alpha_s = reinterpret_cast<float*>(smem + C::kOffAlpha);
  float* inv_s = reinterpret_cast<float*>(smem + C::kOffInv);

  const int lrow = pipe::load_key(tid), u0 = pipe::load_unit(tid, 0);  // loader: token lrow, units u0 + 16k

  SchedView sv(p.sched, p.B, p.num_parts);
  const int pc_begin = sv.part_begin[part], pc_end = sv.part_begin[part + 1];
  const int page_mask = (1 << p.page_log2) - 1;

  for (int pc = pc_begin; pc < pc_end; ++pc) {
    PlanPiece pz;
    if (!read_plan_piece(p, sv, pc, rt * kBM, pz)) continue;  // uniform across the CTA
    const int q0 = pz.q0, rows = pz.rows, L = pz.L, tree_start = pz.tree_start;
    const int slot = pz.slot;
    const int* bt = pz.bt;
    const int k0 = 2 * pz.t0;  // this piece's 16-key tiles, none wholly past L
    const int ntiles = max(min(2 * pz.t1, (L + BN - 1) / BN) - k0, 0);
    const bool qk_work = 16 * g < rows - rt * kBM;  // warp-uniform: a row group past the request skips its mma

    auto page_of = [&](int tile) {
      const int tok = tile * BN + lrow;
      return tok < L ? bt[tok >> p.page_log2] : 0;
    };
    auto issue_tile = [&](int tile, int page, int i) {  // tile -> ring stage i & 3 (tokens past L zero-filled)
      const int tok = tile * BN + lrow;
      const bool ok = tok < L;
      const uint8_t* src =
          ok ? p.kv + (int64_t)page * p.kv_page_stride + (int64_t)(tok & page_mask) * p.kv_row_stride : p.kv;
      const uint32_t dst = sRing + (i & 3) * C::kTile + pipe::kv_off(lrow, u0);
#pragma unroll
      for (int k = 0; k < pipe::kLoadIters; ++k) {
        if (u0 + 16 * k < pipe::kUnits) cp_async16(dst + 2 * k * C::kChunk, src + (u0 + 16 * k) * 16, ok);
      }
    };

    __syncthreads();  // the previous piece is done with every buffer
    row_tile::load_q_rope<C::kThreads>(p, sQpe, tid, rt, rows, q0);  // joins tile 0's cp.async group
#pragma unroll
    for (int i = 0; i < 3; ++i) {  // tiles 0..2, one cp.async group each (empty past the piece)
      if (i < ntiles) issue_tile(k0 + i, page_of(k0 + i), i);
      cp_async_commit();
    }
    int next_page = 3 < ntiles ? page_of(k0 + 3) : 0;

    uint32_t qa[16][4];  // A fragments of latent k-steps 2i + c: rows g8 (+8) of row group g
    row_tile::load_q_latent(p, qa, rt * kBM + 16 * g + g8, rows, q0, c, q4);

    float m = -INFINITY, l = 0.f;  // row lr: reference max (log2 units, scaled) and this thread's partial sum
    float o[4][8][4];               // O[rows mi*16 + g8 (+8), dims 64 warp + nt*8 + 2q4 (+1)]
    row_tile::zero_o(o);

    // S[16 rows of g x 16 keys of tile j] over this warp's k-steps
    auto qk = [&](int j, float (&s)[2][4]) {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[jj][e] = 0.f;
      if (!qk_work) return;
      const uint32_t kv = sRing + (j & 3) * C::kTile;
#pragma unroll
      for (int i = 0; i < pipe::kQkSteps; ++i) {
        uint32_t qpe[4];
        if (i >= 16) ldsm_x4(qpe, sQpe + pipe::rope_a_addr(lane, g, c, i));
        uint32_t bk[4];
        ldsm_x4(bk, kv + pipe::qk_b_addr(lane, c, i));
        mma_bf16(s[0], i < 16 ? qa[i] : qpe, bk[0], bk[1]);
        mma_bf16(s[1], i < 16 ? qa[i] : qpe, bk[2], bk[3]);
      }
    };
    // The pair's halves of tile j's S summed, the tree mask, the online softmax of row lr: P and alpha to buffer j & 1
    auto softmax_to_p = [&](int j, const float (&s)[2][4]) {
      const int tile = k0 + j;
      float sk[2][2];
      row_tile::pair_sum<2>(s, sk, ex, g, c, lane);
      if ((tile + 1) * BN > tree_start) {  // one block the other tiles branch over
        row_tile::tree_mask<2>(sk, p, tile * BN, L, tree_start, rt * kBM + lr, rows, q0, q4);
      }
      __nv_bfloat16* prow = reinterpret_cast<__nv_bfloat16*>(smem + C::kOffP + (j & 1) * C::kPBuf + pipe::p_off(lr, 0));
      row_tile::online_softmax<2>(sk, m, l, p.scale_log2, alpha_s + (j & 1) * kBM + lr, prow, q4);
    };

    if (ntiles > 0) {  // tile 0's scores and P before the loop
      cp_async_wait<2>();
      __syncthreads();  // tile 0 and sQpe are in shared memory
      float s[2][4];
      qk(0, s);
      softmax_to_p(0, s);
    }
    for (int i = 0; i < ntiles; ++i) {
      cp_async_wait<1>();  // this thread's part of tile i + 1
      // P and alpha of tile i from every row; tile i + 1 for every warp; every warp past tile i - 1's PV, so its
      // ring stage ((i + 3) & 3) and its P buffer are free
      __syncthreads();
      if (i + 3 < ntiles) {
        issue_tile(k0 + i + 3, next_page, i + 3);
        if (i + 4 < ntiles) next_page = page_of(k0 + i + 4);
      }
      cp_async_commit();
      row_tile::rescale_o(o, alpha_s + (i & 1) * kBM, lane);
      const bool more = i + 1 < ntiles;
      float s[2][4];
      if (more) qk(i + 1, s);  // issued ahead of PV: the softmax below overlaps the tensor pipe's PV work
      const uint32_t vb = sRing + (i & 3) * C::kTile;
      uint32_t bv[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) ldsm_x4_t(bv[jj], vb + pipe::v_b_addr(lane, warp, jj));
      const uint32_t pb = sPu + (i & 1) * C::kPBuf;
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        uint32_t pa[4];
        ldsm_x4(pa, pb + pipe::p_a_addr(lane, mi));
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          mma_bf16(o[mi][2 * jj], pa, bv[jj][0], bv[jj][1]);
          mma_bf16(o[mi][2 * jj + 1], pa, bv[jj][2], bv[jj][3]);
        }
      }
      if (more) softmax_to_p(i + 1, s);
    }

    // ---- epilogue: the quad's sum is row lr's full sum; its owner writes lse and kv_scale / l, then every warp
    // normalizes and writes its O block
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    cp_async_wait<0>();  // the empty groups; a piece without tiles still issued its sQpe loads
    if (q4 == 0) row_tile::store_row_stats(p, inv_s, lr, rt, rows, q0, slot, m, l);
    __syncthreads();
    row_tile::write_o_block(p, o, inv_s, warp, lane, rt, rows, q0, slot);
  }
}

}  // namespace

void launch_mla_pipelined_main(const MlaParams& p, cudaStream_t stream) {
  launch_row_tiles<mla_tree_verify_pipelined_kernel>(p, PipeCfg::kThreads, PipeCfg::kSmem, stream);
}

}  // namespace ddtree
