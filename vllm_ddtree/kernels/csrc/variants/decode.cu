// MLA tree-verify attention, decode-shaped variant (kVariantDecode): launches of few packed rows per request (plain
// decode and short trees at few heads; auto picks it at <= 32 rows, or <= 64 for a single request), on every GPU
// (sm_80 / sm_90 / sm_120, mma.sync + ldmatrix + cp.async).
//
// Why it exists: those shapes are memory-bound, and the 64-row kernels read their KV at only 21-50 % of the copy
// rate: O = 64 x 512 fp32 in registers allows one 256-thread CTA per SM, and each tile is a chain of
// barrier-separated ring steps, so the SM mostly waits. Here a CTA is 4 warps owning ONE 16-row block (one m16
// tile) of one request, several CTAs share an SM, and a KV tile costs one block barrier:
// - warp w owns 144 of the 576 dims (latent 128w.., rope 512+16w..; variants/decode_layout.cuh). Per 16-key tile it
//   loads only its dims of the 16 keys (cp.async ring of STAGES tiles, warp-private slots), keeps its Q fragments
//   (16 rows x 144 dims, 36 registers) for the whole piece, and computes a partial S = Q K^T over its dims;
// - the 4 partial S (16 x 16 fp32) are summed through a double-buffered shared array: the tile's only
//   __syncthreads. Every warp adds them in the same order, so all warps hold the same S, row max, row sum and P
//   (computed redundantly: 8 values a thread), and P goes from the S accumulators straight into the A fragment
//   of PV (no P in shared memory);
// - PV: warp w computes O[16 x 128] for its own latent dims (64 fp32 registers), from the V bytes it loaded itself.
// fp8 caches: each warp widens its own raw slice to bf16 (warp-local, no barrier).
// Tiles of KSUB 16-key slices (the "deep" configuration of sm_90: KSUB = 2, two CTAs an SM; sm_80 / sm_120's
// "shallow" one: KSUB = 1): a 32-key tile costs one S exchange and one block barrier, the per-tile chain of
// exchange, barrier and softmax is paid once per 32 keys and each warp has twice the independent mma between
// barriers. Slice h of a tile lies at h * slice bytes in the warp's ring slot; a slice wholly past L is zero-filled.
// Below, "16-key tile" reads "slice" where KSUB = 2.
// Split-KV: the requests' tiles are cut into P = CTAs per SM x SMs parts by the line plan of scheduling/sched_plan.cuh, and
// CTA (rt, part) derives its part's pieces (request, tile range, workspace slot) itself at its start (part_plan: two
// block scans over the requests, then a walk from the part's first request), so no planner kernel runs before it
// (one did: docs/results.md, section 6.5). Split requests write normalized partials as bf16 (half the bytes of
// fp32 to write and to merge; each adds at most 2^-9 relative rounding, like the bf16 output) + fp32 base-2 lse into
// the workspace, merged by mla_combine_wide_kernel (combine/combine.cu: a team of 1-32 warps per (request, row,
// 128 dims), over the pieces: a request of B = 1 has hundreds of pieces, one of B = 64 a few).
// Masking: only tiles reaching the tree keys (>= L - n) test the tree bits; keys >= L are zero-filled and masked.
//
// Invariants a reviewer needs (fragment layouts and addresses: variants/decode_layout.cuh, checked on the CPU by
// tests/csrc/decode_frag_check.cpp):
// - Warp-private data: a warp reads only ring slots, Q staging and widening buffers it wrote itself, so
//   cp.async.wait_group + __syncwarp order them (RAW), and the __syncwarp at the top of each tile orders the last
//   tile's ldmatrix reads before the refill of that slot (WAR). Only the S exchange crosses warps.
// - cp.async groups per piece: Q, then STAGES - 1 prologue tiles, then one group per tile (empty past t1). At tile
//   t0 + i the newest STAGES - 1 groups are tiles i+1 .. i+STAGES-1, so wait_group<STAGES - 1> completes tile i (and,
//   before the loop, Q). Tile t0 + i lives in slot i % STAGES; the prefetch of tile i + STAGES - 1 reuses the slot of
//   tile i - 1 (at i = 0 the bf16 Q staging slot, whose fragments are already in registers).
// - S exchange: buffer xb alternates per tile. Warps write partials, __syncthreads, read all four. A warp writes the
//   same buffer again two tiles later, after the next tile's barrier, which every warp reaches only after reading.
// - Every warp sums the 4 partials in the same order, (w0 + w1) + (w2 + w3), so S, the reference max m and its
//   lazy-rescaling decisions, alpha, P and l are bit-identical in all warps; each warp rescales and normalizes its
//   own O columns with them, warp 0 writes the lse.
// - Programmatic dependent launch (sm_90+, launch_kernel in launch.cuh): both kernels start with griddepcontrol.wait, before
//   any memory access, so each sees its predecessor complete (the combine: this kernel's partials and split counts).
// - Rows >= rows (padding of the 16-row block) have zero Q, so finite S, and are never stored. Requests with q_len 0
//   or L = 0 get no piece (the walk skips them), so no block-table read and no write.
// - part_plan runs in every thread before the piece loop (its three __syncthreads are reached by all). Of shared
//   memory it touches only its static PartShared (not the ring or the S exchange), whose fields are final at its
//   last barrier and only read afterwards, so the walk's values (first request, slots, per, line end) are the same
//   in every thread: the piece loop is CTA-uniform.
// - The combine's split counts (DecodeSplitView) are written once per request: by thread 0 of the row-tile-0 CTA of
//   the part holding the request's tile 0, or, for requests without tiles (req_npieces 0), by CTA (0, 0). The combine
//   runs after this kernel on the same stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "device_utils.cuh"
#include "entry_points.h"
#include "launch.cuh"
#include "params.h"
#include "scheduling/sched_plan.cuh"
#include "variants/decode_layout.cuh"

namespace ddtree {
namespace {

using namespace dev;

constexpr int kDecThreads = 128;
// __launch_bounds__ minimum CTAs an SM: 16-key tiles <= 168 registers (3 CTAs in 64K registers), 32-key tiles 2
template <int KSUB>
constexpr int kDecMinBlocks = KSUB == 1 ? 3 : 2;

// KSUB: 16-key slices per KV tile (1 or 2): the tile's keys share one S exchange and one block barrier.
template <bool FP8, int STAGES, int KSUB>
struct DecCfg {
  static constexpr int kTileKeys = dec::kBN * KSUB;
  static constexpr int kSlot = (FP8 ? dec::kSliceFp8 : dec::kSliceBf) * KSUB;  // one warp's part of one stage
  static constexpr int kOffRing = 0;                                            // [warp][stage] slots
  static constexpr int kOffConv = kOffRing + dec::kWarps * STAGES * kSlot;  // fp8: [warp] widened bf16 slices
  static constexpr int kConvWarp = FP8 ? dec::kSliceBf * KSUB : 0;          // one warp's widened slices, bytes
  static constexpr int kOffX = kOffConv + dec::kWarps * kConvWarp;
  static constexpr int kXF4 = 2 * KSUB;                         // float4s of partial S a lane hands over per tile
  static constexpr int kXBuf = dec::kWarps * 32 * kXF4 * 16;    // one S exchange buffer, bytes
  static constexpr int kSmem = kOffX + 2 * kXBuf;
  static_assert(KSUB == 1 || KSUB == 2, "tiles of 16 or 32 keys");
  static_assert(STAGES >= 2, "the ring needs a stage in flight while one is computed");
  static_assert(kSmem <= 232448, "must fit sm_90's 227 KB per block");
  static_assert(kOffX % 16 == 0 && kSlot % 128 == 0, "16-byte aligned buffers");
  static constexpr int kLoadIts = FP8 ? 5 : 9;  // cp.async units per lane per slice (fp8: 4.5)
};

// Configurations. Deep (two CTAs fit an SM: sm_90; not sm_80's 164 KB): 32-key tiles, 2 bf16 / 3 fp8 stages
// (90,112 / 108,544 B, 2 CTAs an SM). Shallow (sm_80 and the 100 KB-per-SM GPUs sm_86 / sm_89 / sm_120, or
// VLLM_DDTREE_MLA_VARIANT=decode-shallow): 16-key tiles, 2 stages (45,056 B, two or more CTAs an SM).
constexpr int kDeepSub = 2, kDeepStagesBf16 = 2, kDeepStagesFp8 = 3;
constexpr int kShallowSub = 1, kShallowStages = 2;

// Inclusive prefix sum of v over the warp.
__device__ __forceinline__ int warp_incl_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// part_plan's shared memory: the two scans' warp sums, then this part's walk start and line range.
struct PartShared {
  int warp_cost[dec::kWarps], warp_slots[dec::kWarps];
  plan::PartCursor cur;  // cur.b = B: no pieces
  int per, hi;           // line units per part, end of this part's line range
};

// This CTA's part of the split plan (scheduling/sched_plan.cuh) into s. Thread t sums the contiguous requests
// [t * chunk, (t + 1) * chunk) (any B: chunk = ceil(B / 128)): a block scan of their line costs gives the line length
// (so `per`) and each range's line start; a second one, of their split requests' slots, the slots before the
// request that holds the part's start x, whose thread then publishes the cursor. Three barriers, each scan's warp
// sums in their own array (no reuse to order). Requests without tiles get req_npieces 0 from CTA (0, 0) (no part
// visits them); the others from the walk. The walk reads the slots, per and hi from s at every piece rather than
// keeping them in registers: live across the tile loop, they made ptxas spill (sm_90: bf16 2-stage 8 B, fp8 5-stage
// 4 B).
__device__ __forceinline__ void part_plan(const MlaParams& p, int part, int bn, bool zero_empty, PartShared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = (p.B + kDecThreads - 1) / kDecThreads;
  const int b0 = min(p.B, static_cast<int>(threadIdx.x) * chunk), b1 = min(p.B, b0 + chunk);
  const DecodeSplitView sv(p.sched, p.B);
  // ---- scan 1: line costs
  const int cost = plan::range_cost(b0, b1, p.seq_lens, p.qsl, bn, kSchedOverhead,
                                    zero_empty ? sv.req_npieces : nullptr, sv.req_slot0);
  const int cincl = warp_incl_scan(cost);
  if (lane == 31) s.warp_cost[warp] = cincl;
  __syncthreads();
  int cbase = cincl - cost, total = 0;
#pragma unroll
  for (int w = 0; w < dec::kWarps; ++w) {
    cbase += w < warp ? s.warp_cost[w] : 0;
    total += s.warp_cost[w];
  }
  const int per = plan::part_len(total, p.num_parts, kSchedOverhead, plan::kLineMinTiles);
  const int x = part * per;
  // ---- scan 2: split requests' slots
  plan::PartCursor cur{-1, 0, 0, 0};
  const int ns = plan::range_slots(b0, b1, cbase, x, per, p.seq_lens, p.qsl, bn, kSchedOverhead, cur);
  const int gincl = warp_incl_scan(ns);
  if (lane == 31) s.warp_slots[warp] = gincl;
  __syncthreads();
  if (cur.b >= 0) {  // the owner of x: exactly one thread when x < total, none otherwise
    int gbase = gincl - ns;
#pragma unroll
    for (int w = 0; w < dec::kWarps; ++w) gbase += w < warp ? s.warp_slots[w] : 0;
    s.cur = plan::PartCursor{cur.b, cur.c, cur.g + gbase, cur.g_next + gbase};
  }
  if (threadIdx.x == 0) {
    if (x >= total) s.cur = plan::PartCursor{p.B, 0, 0, 0};  // the part starts past the line's end: no pieces
    s.per = per;
    s.hi = min(x + per, total);
  }
  __syncthreads();
}

template <bool FP8, int STAGES, int KSUB>
__global__ void __launch_bounds__(kDecThreads, kDecMinBlocks<KSUB>) mla_decode_verify_kernel(const MlaParams p) {
  using C = DecCfg<FP8, STAGES, KSUB>;
  constexpr int kTK = C::kTileKeys;
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q4 = lane & 3;
  const int rt = blockIdx.x, part = blockIdx.y;

  const uint32_t sbase = smem_u32(smem);
  const uint32_t ring = sbase + C::kOffRing + warp * STAGES * C::kSlot;  // this warp's STAGES slots
  const uint32_t conv = sbase + C::kOffConv + warp * C::kConvWarp;  // fp8: this warp's widened slices
  // Q staging: the warp's last ring slot (bf16; first refilled by the first tile's prefetch, after Q is in
  // registers) or its widening buffer (fp8; first written by the first tile's widening, same ordering).
  const uint32_t qstage = FP8 ? conv : ring + (STAGES - 1) * C::kSlot;
  float* xs = reinterpret_cast<float*>(smem + C::kOffX);

  grid_dep_wait();  // launched with PDL (sm_90+): every input and output below belongs to earlier kernels until here
  grid_dep_launch();
  __shared__ PartShared plan_s;  // static, 56 B (128 B of the CTA's shared memory with the dynamic buffer's alignment)
  part_plan(p, part, kTK, rt == 0 && part == 0, plan_s);
  const int page_mask = (1 << p.page_log2) - 1;
  const bool big_pages = p.page_log2 >= 4;  // a 16-key tile (16-aligned) then lies in one page
  const int row_bytes = static_cast<int>(p.kv_row_stride);  // < 2^31 (checked by the binding)
  int xb = 0;  // S exchange buffer; alternates every tile, across pieces too (CTA-uniform)

  // The part's pieces, request by request from its first one (scheduling/sched_plan.cuh); CTA-uniform throughout.
  int c = plan_s.cur.c;  // line start of request b
  for (int b = plan_s.cur.b; b < p.B; ++b) {
    const int q0 = p.qsl[b];
    const int n = p.qsl[b + 1] - q0;
    const int L = p.seq_lens[b];
    const int k = plan::req_tiles(n, L, kTK);
    if (k == 0) continue;  // q_len 0 (graph padding) or L = 0: no piece, no block-table read, no write
    plan::PartPiece pc;
    const int slots_before = b == plan_s.cur.b ? plan_s.cur.g : plan_s.cur.g_next;
    if (!plan::part_piece(k, part, plan_s.per, plan_s.hi, kSchedOverhead, slots_before, c, pc)) break;
    if (rt == 0 && pc.first && threadIdx.x == 0) {  // one CTA per request: the combine's split counts
      const DecodeSplitView sv(p.sched, p.B);
      sv.req_npieces[b] = pc.npieces;
      sv.req_slot0[b] = pc.slot0;
    }
    const int rows = n * p.H;
    if (rt * dec::kRows >= rows) continue;  // no row of this block in the request
    const int t0 = pc.t0, t1 = pc.t1;
    const int slot = pc.slot;
    const int tree_start = L - n;
    const int* bt = p.block_table + (int64_t)b * p.bt_stride;

    // this warp's dims of the keys of `tile` -> ring slot at `dst` (keys >= L zero-filled, block table untouched)
    auto unit_of = [&](int i, int& r, uint32_t& off, int& col) {  // col: byte column in the cache row
      int dim;
      if constexpr (FP8) {
        uint32_t d0, d1;
        dec::fp8_unit(i, warp, r, off, dim, d0, d1);
        col = dim;
      } else {
        dec::bf16_unit(i, warp, r, off, dim);
        col = 2 * dim;
      }
    };
    // Page of the first key of `tile` (pages of >= 16 tokens): read one tile ahead of its issue in the loop below, so
    // the block-table load's latency is not paid between a warp's compute and its cp.asyncs (it was, twice a tile).
    // A second slice lies in the same page when pages hold >= 32 tokens; with 16-token pages it reads its own entry.
    auto page_of = [&](int tile) { return big_pages && tile < t1 ? bt[(tile * kTK) >> p.page_log2] : 0; };
    auto issue = [&](int tile, uint32_t dst, int pg) {
#pragma unroll
      for (int h = 0; h < KSUB; ++h) {  // the tile's 16-key slices, one after the other in the warp's slot
        const int key0 = tile * kTK + h * dec::kBN;  // slice 0: < L (tile < t1 <= ceil(L / kTK)); slice 1 may not be
        const int nvalid = L - key0;                  // rows r < nvalid of the slice are keys < L
        const uint32_t sdst = dst + h * (C::kSlot / KSUB);
        // every unit of this warp's slice: its 16 bytes from src_of(row r of the slice, byte column col)
        auto load_units = [&](auto src_of) {
#pragma unroll
          for (int it = 0; it < C::kLoadIts; ++it) {
            const int i = lane + 32 * it;
            if (FP8 && i >= dec::kUnitsFp8) continue;
            int r, col;
            uint32_t off;
            unit_of(i, r, off, col);
            cp_async16(sdst + off, src_of(r, col), r < nvalid);
          }
        };
        if (KSUB > 1 && nvalid <= 0) {  // a slice wholly past L: zero-filled, no block-table read
          load_units([&](int, int) { return p.kv; });
        } else if (big_pages) {
          // One page holds the whole slice (16-aligned, >= 16 tokens a page): one block-table read; rows past L are
          // still inside that page, so their address is formed unconditionally (src-size 0 reads nothing).
          const int page = h == 0 || p.page_log2 >= 5 ? pg : bt[key0 >> p.page_log2];
          const uint8_t* base = p.kv + (int64_t)page * p.kv_page_stride +
                                (int64_t)(key0 & page_mask) * p.kv_row_stride;
          load_units([&](int r, int col) { return base + static_cast<uint32_t>(r * row_bytes + col); });
        } else {  // pages of fewer than 16 tokens: a block-table read per key
          load_units([&](int r, int col) {
            const int key = key0 + r;
            const uint8_t* src = p.kv;
            if (r < nvalid)
              src += (int64_t)bt[key >> p.page_log2] * p.kv_page_stride +
                     (int64_t)(key & page_mask) * p.kv_row_stride + col;
            return src;
          });
        }
      }
    };

    __syncwarp();  // every lane is done with this warp's slots (previous piece)
    // ---- Q: rows rt*16 .. +15 of the request (zero past `rows`), this warp's 144 dims -> qstage (bf16 slice)
#pragma unroll
    for (int it = 0; it < 9; ++it) {
      int r, dim;
      uint32_t off;
      dec::bf16_unit(lane + 32 * it, warp, r, off, dim);
      const int row = rt * dec::kRows + r;
      const bool valid = row < rows;
      const int node = valid ? row / p.H : 0, head = valid ? row % p.H : 0;
      const int64_t tok = q0 + node;
      const uint8_t* src =
          dim < kDV ? reinterpret_cast<const uint8_t*>(p.q_nope) + (tok * p.q_nope_s0 + head * p.q_nope_s1 + dim) * 2
                    : reinterpret_cast<const uint8_t*>(p.q_pe) +
                          (tok * p.q_pe_s0 + head * p.q_pe_s1 + (dim - kDV)) * 2;
      if (!p.q_fp16) {
        cp_async16(qstage + off, valid ? src : reinterpret_cast<const uint8_t*>(p.q_nope), valid);
      } else {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid) v = half8_to_bf16(*reinterpret_cast<const uint4*>(src));
        sts128(qstage + off, v);
      }
    }
    cp_async_commit();  // group: Q
    // ---- prologue: tiles t0 .. t0 + STAGES - 2 into slots 0 .. STAGES - 2, one group each (empty past t1)
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (t0 + s < t1) issue(t0 + s, ring + s * C::kSlot, page_of(t0 + s));
      cp_async_commit();
    }
    int pg_next = page_of(t0 + STAGES - 1);  // page of the tile the loop issues next
    cp_async_wait<STAGES - 1>();  // Q landed (the STAGES - 1 tile groups may still be in flight)
    __syncwarp();
    uint32_t qa[dec::kKSteps][4];  // A fragments of Q over this warp's 9 k-steps, for the whole piece
#pragma unroll
    for (int kk = 0; kk < dec::kKSteps; ++kk) ldsm_x4(qa[kk], qstage + dec::qa_addr(lane, kk));

    // softmax state of rows g (index 0) and g + 8 (index 1), identical in all 4 warps; l: this lane's columns only
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float o[dec::kVTiles][4];  // O[rows g / g+8][dims o_dim(warp, j, q4, e)]
#pragma unroll
    for (int j = 0; j < dec::kVTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = 0.f;

    int rd = 0;  // ring slot of the tile being computed: tile t0 + i lives in slot i % STAGES
    for (int tile = t0; tile < t1; ++tile) {
      __syncwarp();  // every lane is done reading the slot refilled next (tile - 1's; at t0: Q's staging)
      {
        const int nt = tile + STAGES - 1;
        const int ws = rd == 0 ? STAGES - 1 : rd - 1;  // (i + STAGES - 1) % STAGES
        if (nt < t1) issue(nt, ring + ws * C::kSlot, pg_next);
        cp_async_commit();
        pg_next = page_of(nt + 1);  // consumed next tile
      }
      cp_async_wait<STAGES - 1>();  // this tile's group is complete (only the STAGES - 1 newer ones pending)
      __syncwarp();                 // ... for every lane's copies
      uint32_t kvb = ring + rd * C::kSlot;
      rd = rd + 1 == STAGES ? 0 : rd + 1;
      if constexpr (FP8) {  // widen this warp's raw slices into its bf16 slices
#pragma unroll
        for (int h = 0; h < KSUB; ++h)
#pragma unroll
          for (int it = 0; it < C::kLoadIts; ++it) {
            const int i = lane + 32 * it;
            if (i >= dec::kUnitsFp8) continue;
            int r, dim;
            uint32_t off, d0, d1;
            dec::fp8_unit(i, warp, r, off, dim, d0, d1);
            uint4 w[2];
            fp8x16_to_bf16(lds128(kvb + h * dec::kSliceFp8 + off), w);
            sts128(conv + h * dec::kSliceBf + d0, w[0]);
            sts128(conv + h * dec::kSliceBf + d1, w[1]);
          }
        __syncwarp();
        kvb = conv;
      }

      // ---- partial S[16 rows x kTK keys] over this warp's 144 dims; n-tile k: keys 8k .. 8k + 7 of the tile
      constexpr int kNT = 2 * KSUB;
      float s[kNT][4];
#pragma unroll
      for (int k = 0; k < kNT; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[k][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < dec::kKSteps; ++kk)
#pragma unroll
        for (int h = 0; h < KSUB; ++h) {
          uint32_t bq[4];
          ldsm_x4(bq, kvb + h * dec::kSliceBf + dec::kb_addr(lane, kk));
          mma_bf16(s[2 * h], qa[kk], bq[0], bq[1]);      // keys 16h + 0-7
          mma_bf16(s[2 * h + 1], qa[kk], bq[2], bq[3]);  // keys 16h + 8-15
        }

      // ---- the 4 partial sums -> full S in every warp (same order everywhere: bit-identical across warps)
#pragma unroll
      for (int k = 0; k < kNT; ++k)
        *reinterpret_cast<float4*>(xs + dec::xs_off(xb, warp, k, lane, kNT)) =
            make_float4(s[k][0], s[k][1], s[k][2], s[k][3]);
      __syncthreads();  // the tile's only block barrier (the other buffer is rewritten only after the next one)
#pragma unroll
      for (int k = 0; k < kNT; ++k) {
        float4 a[dec::kWarps];
#pragma unroll
        for (int w = 0; w < dec::kWarps; ++w)
          a[w] = *reinterpret_cast<const float4*>(xs + dec::xs_off(xb, w, k, lane, kNT));
        s[k][0] = (a[0].x + a[1].x) + (a[2].x + a[3].x);
        s[k][1] = (a[0].y + a[1].y) + (a[2].y + a[3].y);
        s[k][2] = (a[0].z + a[1].z) + (a[2].z + a[3].z);
        s[k][3] = (a[0].w + a[1].w) + (a[2].w + a[3].w);
      }
      xb ^= 1;

      // ---- online softmax (log2 domain) of rows g, g + 8 over keys tile*kTK + 8k + 2*q4 + (e & 1). S stays
      // unscaled (scale_log2 > 0, checked by the binding, so the max commutes with it) and enters exp2 through one
      // FFMA. Only tiles reaching the tree keys (or L) are masked, in one block that the others branch over.
      if ((tile + 1) * kTK > tree_start) {
        uint64_t bits[2] = {~0ull, ~0ull};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = rt * dec::kRows + g + 8 * h;
          if (row < rows) bits[h] = static_cast<uint64_t>(p.tree_bits[q0 + row / p.H]);
        }
#pragma unroll
        for (int k = 0; k < kNT; ++k)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = tile * kTK + k * 8 + 2 * q4 + (e & 1);
            const int tk = key - tree_start;
            const bool vis = key < L && (tk < 0 || ((bits[e >> 1] >> (tk & 63)) & 1ull));
            s[k][e] = vis ? s[k][e] : -INFINITY;
          }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int k = 0; k < kNT; ++k)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[k][e]);
      // Lazy rescaling: a row's reference max m moves only when the tile's max exceeds it by more than kRescaleSlack
      // (log2 units), so P <= 2^kRescaleSlack (bf16 keeps its relative precision) and O is rescaled on few tiles
      // (it was on two in three at B = 1 x 128k, H 8: 64 FMUL a warp each). m, l and O stay consistent: lse = m +
      // log2(l) whatever m is. Every warp makes the same decision (same S).
      bool moved = false;
      float nms[2], alpha[2];  // nms: -m, the exp2 FFMA's addend; alpha: O's factor
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float mt = mx[h] * p.scale_log2;  // the tile's row max, scaled (-inf: fully masked)
        alpha[h] = 1.f;
        if (mt > m[h] + kRescaleSlack) {  // false while mt = -inf; true for the first finite max (m = -inf)
          alpha[h] = fast_exp2(m[h] - mt);
          m[h] = mt;
          l[h] *= alpha[h];
          moved = true;
        }
        nms[h] = m[h] == -INFINITY ? 0.f : -m[h];  // fully masked so far: keep exp2 finite (its P are 0)
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int j = 0; j < dec::kVTiles; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
      }
      uint32_t pa[KSUB][4];  // P as the A operand of PV, one k-step per slice (C layout of S -> A layout)
#pragma unroll
      for (int h = 0; h < KSUB; ++h) {
        const float(&s0)[4] = s[2 * h];
        const float(&s1)[4] = s[2 * h + 1];
        const float sc = p.scale_log2;
        const float p00 = fast_exp2(fmaf(s0[0], sc, nms[0])), p01 = fast_exp2(fmaf(s0[1], sc, nms[0]));
        const float p02 = fast_exp2(fmaf(s0[2], sc, nms[1])), p03 = fast_exp2(fmaf(s0[3], sc, nms[1]));
        const float p10 = fast_exp2(fmaf(s1[0], sc, nms[0])), p11 = fast_exp2(fmaf(s1[1], sc, nms[0]));
        const float p12 = fast_exp2(fmaf(s1[2], sc, nms[1])), p13 = fast_exp2(fmaf(s1[3], sc, nms[1]));
        l[0] += (p00 + p01) + (p10 + p11);
        l[1] += (p02 + p03) + (p12 + p13);
        pa[h][0] = pack_bf16(p00, p01);  // row g,     keys 16h + 2q4, +1
        pa[h][1] = pack_bf16(p02, p03);  // row g + 8, keys 16h + 2q4, +1
        pa[h][2] = pack_bf16(p10, p11);  // row g,     keys 16h + 8 + 2q4, +1
        pa[h][3] = pack_bf16(p12, p13);  // row g + 8, keys 16h + 8 + 2q4, +1
      }

      // ---- O[16 x this warp's 128 latent dims] += P V, one 16-key k-step per slice
#pragma unroll
      for (int h = 0; h < KSUB; ++h)
#pragma unroll
        for (int jj = 0; jj < dec::kVTiles / 2; ++jj) {
          uint32_t bv[4];
          ldsm_x4_t(bv, kvb + h * dec::kSliceBf + dec::vb_addr(lane, jj));
          mma_bf16(o[2 * jj], pa[h], bv[0], bv[1]);
          mma_bf16(o[2 * jj + 1], pa[h], bv[2], bv[3]);
        }
    }

    // ---- epilogue: full row sums, then each warp writes its 128 dims; warp 0 writes the lse
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    const int rstride = p.max_q * p.H;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rt * dec::kRows + g + 8 * h;
      if (row >= rows) continue;
      const float lt = l[h];
      const float inv = lt > 0.f ? p.kv_scale / lt : 0.f;
      const int node = row / p.H, head = row % p.H;
      const int64_t tok = q0 + node;
      if (warp == 0 && q4 == 0) {
        const float lse2 = lt > 0.f ? m[h] + log2f(lt) : -INFINITY;
        if (slot < 0) {
          p.lse[tok * p.lse_s0 + head * p.lse_s1] = lse2 * kLn2;
        } else {
          p.ws_lse[(int64_t)slot * rstride + row] = lse2;
        }
      }
      if (slot < 0) {
        char* orow = reinterpret_cast<char*>(p.out) + (tok * p.out_s0 + head * p.out_s1) * 2;
#pragma unroll
        for (int j = 0; j < dec::kVTiles; ++j) {
          const int d = dec::o_dim(warp, j, q4, 0);
          const float x0 = o[j][2 * h] * inv, x1 = o[j][2 * h + 1] * inv;
          *reinterpret_cast<uint32_t*>(orow + d * 2) = pack_out(x0, x1, p.out_fp16);
        }
      } else {
        uint16_t* wrow = p.ws_o_bf16 + ((int64_t)slot * rstride + row) * kDV;
#pragma unroll
        for (int j = 0; j < dec::kVTiles; ++j) {
          const int d = dec::o_dim(warp, j, q4, 0);  // even: 4-byte aligned pair
          *reinterpret_cast<uint32_t*>(wrow + d) = pack_bf16(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
        }
      }
    }
  }
}

using DeepBf16 = DecCfg<false, kDeepStagesBf16, kDeepSub>;
using DeepFp8 = DecCfg<true, kDeepStagesFp8, kDeepSub>;
static_assert(DecCfg<false, kShallowStages, kShallowSub>::kSmem <= 101376 &&
                  DecCfg<true, kShallowStages, kShallowSub>::kSmem <= 101376,
              "the shallow configuration must fit sm_120's 99 KB per block");
// The dispatch (vllm_ddtree/kernels/mla_dispatch.py) picks the deep configuration where two CTAs of it fit an SM,
// from these sizes (constants.MLA_DECODE_DEEP_SMEM_*), else the shallow one.
static_assert(DeepBf16::kSmem == kDecodeDeepSmemBf16 && DeepFp8::kSmem == kDecodeDeepSmemFp8,
              "kDecodeDeepSmem* are the deep configurations' shared memory");

// CTAs of one configuration resident on an SM of `device` (cached per device: device_cache.h).
template <bool FP8, int STAGES, int KSUB>
int occupancy(int device) {
  return max_active_ctas<mla_decode_verify_kernel<FP8, STAGES, KSUB>>(device, kDecThreads,
                                                                      DecCfg<FP8, STAGES, KSUB>::kSmem);
}

template <bool FP8, int STAGES, int KSUB>
void launch_decode_main(const MlaParams& p, int device, bool pdl, cudaStream_t stream) {
  ensure_dynamic_smem<mla_decode_verify_kernel<FP8, STAGES, KSUB>>(DecCfg<FP8, STAGES, KSUB>::kSmem, device);
  launch_kernel(mla_decode_verify_kernel<FP8, STAGES, KSUB>, dim3(p.num_row_tiles, p.num_parts), kDecThreads,
                DecCfg<FP8, STAGES, KSUB>::kSmem, stream, pdl, p);
}

}  // namespace

int mla_decode_ctas_per_sm(int device, bool fp8, bool deep) {
  if (fp8) return deep ? occupancy<true, kDeepStagesFp8, kDeepSub>(device)
                       : occupancy<true, kShallowStages, kShallowSub>(device);
  return deep ? occupancy<false, kDeepStagesBf16, kDeepSub>(device)
              : occupancy<false, kShallowStages, kShallowSub>(device);
}

void launch_mla_decode(const MlaParams& p, bool deep, bool pdl, cudaStream_t stream) {
  int device = 0;
  cudaGetDevice(&device);
  if (p.kv_fp8) {
    if (deep) launch_decode_main<true, kDeepStagesFp8, kDeepSub>(p, device, pdl, stream);
    else launch_decode_main<true, kShallowStages, kShallowSub>(p, device, pdl, stream);
  } else {
    if (deep) launch_decode_main<false, kDeepStagesBf16, kDeepSub>(p, device, pdl, stream);
    else launch_decode_main<false, kShallowStages, kShallowSub>(p, device, pdl, stream);
  }
}

}  // namespace ddtree
