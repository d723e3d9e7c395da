// MLA tree-verify attention, resident-V path: large-shared-memory GPUs (sm_90, ~226 KB a block), mma.sync.
//
// One CTA owns 64 packed rows r = node*H + head of one request and streams that request's KV tiles (64 tokens):
// two whole tiles of 9 swizzled 64-dim chunks stay resident, the next one streams in (issued at the start of this one)
// while this one is computed, and V is read from the K chunks already in shared memory; an fp8 tile is widened to bf16
// once, at its start. Q (64 x 576 bf16 = 72 KB) stays resident in shared memory and mma.sync reads every operand from
// there per warp, so the warp tiles keep the bytes per mma low:
// - QK: warp (row half, key half kq, k-step half dh) adds k-steps 2dh, 2dh+1 of every chunk into S[32 x 32];
//   the dh pair then swaps 16-row blocks through shared memory and each keeps one block's full sums for the softmax.
// - PV: warp (row half, dim quarter) owns O[32 rows x 16 dims of every 64-dim chunk] (128 fp32 registers), so V is
//   read by 2 warps, not 4; P and the per-row rescale (whose softmax rows belong to other warps) pass through shared
//   memory.
// GPUs without that shared memory take the portable kernel (variants/portable.cu); few rows a request go to the
// decode kernel (variants/decode.cu). Split-KV: the device scheduler (scheduling/sched_kernel.cu) hands each part a
// list of pieces (request, tile range); a request cut into several pieces writes normalized fp32 partials + base-2
// lse, merged by the row-tile combine (combine/combine.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "device_utils.cuh"
#include "entry_points.h"
#include "launch.cuh"
#include "params.h"
#include "scheduling/plan_piece.cuh"

namespace ddtree {
namespace {

using namespace dev;  // device_utils.cuh

template <bool FP8>
struct KCfg {
  static constexpr int BN = 64;  // tokens per KV tile
  static constexpr int kThreads = 256;
  static constexpr int kRowBytes = FP8 ? 64 : 128;  // raw bytes per token in one 64-dim chunk
  static constexpr int kRawChunk = BN * kRowBytes;
  static constexpr int kBfChunk = BN * 128;
  static constexpr int kPStride = BN + 8;  // bf16 elements per sP row (padding avoids ldmatrix bank conflicts)
  static constexpr int kOffRing = 9 * kBM * 128;  // sQ: 9 swizzled [64 x 64] bf16 chunks = 72 KB
  static constexpr int kOffConv = kOffRing + 2 * 9 * kRawChunk;  // two resident tiles
  static constexpr int kOffP = kOffConv + (FP8 ? 9 * kBfChunk : 0);
  static constexpr int kOffRed = kOffP + kBM * kPStride * 2;
  static constexpr int kSmem = kOffRed + 4 * kBM * 4;  // row maxima / sums per key half, then alpha or 1/l per row
  static_assert(kSmem <= 232448, "resident-V path must fit sm_90's 227 KB per block");
  static constexpr int kUnitsPerRow = kRowBytes / 16;
  static constexpr int kUnits = BN * kUnitsPerRow;  // 16-byte cp.async units per chunk
  static constexpr int kLoadIters = (kUnits + kThreads - 1) / kThreads;
  // Warp tiles (see the top of the file): QK k-steps split across a warp pair, PV over 32 rows.
  static constexpr int kPVM = 2;   // 16-row blocks per warp in PV
  static constexpr int kPVNJ = 2;  // 8-dim n-tiles per warp per V chunk
  static constexpr int kQKM = 2;   // 16-row blocks per warp in QK
  static constexpr int kQKKS = 2;  // k-steps per 64-dim chunk per warp in QK
  static constexpr int kQKNT = BN / 16;  // 8-key n-tiles per warp in QK (warp covers BN/2 keys)
  static constexpr int kPVKS = BN / 16;  // 16-key k-steps in PV
  // The S exchange: each warp hands its partner 16 rows x BN/2 keys of fp32 partial sums; one half of the warps
  // writes into the chunk-8 buffer (dead once QK is done), the other into sP (written only after the exchange).
  static constexpr int kExWarp = kQKNT * 4 * 32 * 4;
  static_assert(4 * kExWarp <= kBfChunk && 4 * kExWarp <= kBM * kPStride * 2, "exchange halves must fit");
};
static_assert(KCfg<false>::BN == mla_variant_block_n(kVariantResidentV) &&
                  KCfg<true>::BN == mla_variant_block_n(kVariantResidentV),
              "the scheduler plans in this kernel's KV tiles");

template <bool FP8>
__global__ void __launch_bounds__(256, 1) mla_tree_verify_kernel(const MlaParams p) {
  using C = KCfg<FP8>;
  constexpr int BN = C::BN;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // needs ~226 KB of shared memory per block: never launched before sm_90, so not built
#else
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Row half = warp >> 2, so rows 0-31 belong to warps 0-3, one per SM sub-partition (warp % 4); with this
  // assignment ptxas allocates the kernel without spills (20 / 56 bytes with row half = warp & 1).
  const int rh = warp >> 2;                      // QK and PV: row half
  const int pv_row0 = rh * 32;                   // PV: first row of this warp's O block
  const int pv_d0 = (warp & 3) * 8 * C::kPVNJ;  // PV: first dim of its slice of every chunk
  const int kq = (warp >> 1) & 1;                // QK: key half
  const int dh = warp & 1;                       // QK: k-step half
  const int qk_row0 = rh * 32;                   // QK: first row of this warp's tile (= pv_row0)
  const int g = lane >> 2, q4 = lane & 3;
  const int own0 = qk_row0 + dh * 16 + g, own1 = own0 + 8;  // the two rows whose softmax this thread keeps
  const int rt = blockIdx.x, part = blockIdx.y;

  const uint32_t sQ = smem_u32(smem);
  const uint32_t sRing = smem_u32(smem + C::kOffRing);
  const uint32_t sConv = smem_u32(smem + C::kOffConv);
  const uint32_t sPu = smem_u32(smem + C::kOffP);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + C::kOffP);
  float* red = reinterpret_cast<float*>(smem + C::kOffRed);  // [2][kBM] per key half
  float* srow = red + 2 * kBM;                                 // [kBM] alpha per tile, 1/l at the end

  SchedView sv(p.sched, p.B, p.num_parts);
  const int pc_begin = sv.part_begin[part], pc_end = sv.part_begin[part + 1];
  const int page_mask = (1 << p.page_log2) - 1;

  for (int pc = pc_begin; pc < pc_end; ++pc) {
    PlanPiece pz;
    if (!read_plan_piece(p, sv, pc, rt * kBM, pz)) continue;  // uniform across the CTA
    const int q0 = pz.q0, rows = pz.rows, L = pz.L, tree_start = pz.tree_start;
    const int t0 = pz.t0, t1 = pz.t1, slot = pz.slot;
    const int* bt = pz.bt;

    __syncthreads();  // previous piece is done with sQ / ring / red

    // ---- Q tile -> sQ (swizzled chunks of 64 dims); rows past the request are zero.
    for (int i = tid; i < kBM * 72; i += C::kThreads) {
      const int r = i / 72, u = i % 72;
      const int row = rt * kBM + r;
      const bool valid = row < rows;
      const int node = valid ? row / p.H : 0, head = valid ? row % p.H : 0;
      const int64_t tok = q0 + node;
      const uint32_t dst = sQ + (u >> 3) * (kBM * 128) + swz(r, u & 7);
      const uint8_t* src;
      if (u < 64) {
        src = reinterpret_cast<const uint8_t*>(p.q_nope) + (tok * p.q_nope_s0 + head * p.q_nope_s1 + u * 8) * 2;
      } else {
        src = reinterpret_cast<const uint8_t*>(p.q_pe) + (tok * p.q_pe_s0 + head * p.q_pe_s1 + (u - 64) * 8) * 2;
      }
      if (!p.q_fp16) {
        cp_async16(dst, valid ? src : reinterpret_cast<const uint8_t*>(p.q_nope), valid);
      } else {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid) {
          const uint4 h = *reinterpret_cast<const uint4*>(src);
          const __half2* hh = reinterpret_cast<const __half2*>(&h);
          float2 f0 = __half22float2(hh[0]), f1 = __half22float2(hh[1]);
          float2 f2 = __half22float2(hh[2]), f3 = __half22float2(hh[3]);
          v = make_uint4(pack_bf16(f0.x, f0.y), pack_bf16(f1.x, f1.y), pack_bf16(f2.x, f2.y),
                         pack_bf16(f3.x, f3.y));
        }
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
      }
    }

    // ---- per-thread KV row pointers for the tile being loaded
    const uint8_t* rowptr[C::kLoadIters];
    bool rowok[C::kLoadIters];
    int nextpage[C::kLoadIters];
    auto row_of = [&](int it) { return (tid + it * C::kThreads) / C::kUnitsPerRow; };
    auto unit_of = [&](int it) { return (tid + it * C::kThreads) % C::kUnitsPerRow; };
    auto set_rows = [&](int tile, const int* pages) {
#pragma unroll
      for (int it = 0; it < C::kLoadIters; ++it) {
        const int tok = tile * BN + row_of(it);
        rowok[it] = (tid + it * C::kThreads) < C::kUnits && tok < L;
        rowptr[it] = rowok[it] ? p.kv + (int64_t)pages[it] * p.kv_page_stride + (int64_t)(tok & page_mask) * p.kv_row_stride
                               : p.kv;
      }
    };
    auto fetch_pages = [&](int tile, int* pages) {
#pragma unroll
      for (int it = 0; it < C::kLoadIters; ++it) {
        const int tok = tile * BN + row_of(it);
        pages[it] = ((tid + it * C::kThreads) < C::kUnits && tok < L) ? bt[tok >> p.page_log2] : 0;
      }
    };
    auto load_chunk = [&](int dchunk, int wslot) {
#pragma unroll
      for (int it = 0; it < C::kLoadIters; ++it) {
        if ((tid + it * C::kThreads) < C::kUnits) {
          const int r = row_of(it), u = unit_of(it);
          const uint32_t dst = sRing + wslot * C::kRawChunk + (FP8 ? (r * 64 + u * 16) : swz(r, u));
          cp_async16(dst, rowptr[it] + dchunk * C::kRowBytes + u * 16, rowok[it]);
        }
      }
    };

    auto widen_chunk = [&](uint32_t src, uint32_t dst) {  // fp8 chunk -> swizzled bf16 chunk
      if (tid < C::kUnits) {
        const int r = tid / 4, u = tid % 4;
        uint4 raw;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                     : "r"(src + r * 64 + u * 16));
        uint4 w[2];
        fp8x16_to_bf16(raw, w);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + swz(r, 2 * u)), "r"(w[0].x), "r"(w[0].y),
                     "r"(w[0].z), "r"(w[0].w));
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + swz(r, 2 * u + 1)), "r"(w[1].x),
                     "r"(w[1].y), "r"(w[1].z), "r"(w[1].w));
      }
    };

    {
      int pages[C::kLoadIters];
      fetch_pages(t0, pages);
      set_rows(t0, pages);
    }
    // prologue: all 9 chunks of tile t0 in one group (with Q)
#pragma unroll
    for (int s = 0; s < 9; ++s) load_chunk(s, s);
    cp_async_commit();
    if (t0 + 1 < t1) fetch_pages(t0 + 1, nextpage);

    // ---- softmax state of the two kept rows (own0, own1; partial sums over this warp's key half)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    // O[vc][mi][nj]: rows pv_row0 + mi*16 + (g, g+8), dims vc*64 + pv_d0 + nj*8 + 2*q4 (+1)
    float o[8][C::kPVM][C::kPVNJ][4];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int mi = 0; mi < C::kPVM; ++mi)
#pragma unroll
        for (int nj = 0; nj < C::kPVNJ; ++nj)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[c][mi][nj][e] = 0.f;

    for (int tile = t0; tile < t1; ++tile) {
      const int tslot = (tile - t0) & 1;  // which resident tile buffer holds this tile
      cp_async_wait<0>();
      __syncthreads();  // this tile is in shared memory, and every warp is done with the other buffer
      if (tile + 1 < t1) {  // the next tile streams in while this one is computed
        set_rows(tile + 1, nextpage);
#pragma unroll
        for (int s = 0; s < 9; ++s) load_chunk(s, (tslot ^ 1) * 9 + s);
        cp_async_commit();
        if (tile + 2 < t1) fetch_pages(tile + 2, nextpage);  // used one tile later
      }
      if constexpr (FP8) {
#pragma unroll 1
        for (int cc = 0; cc < 9; ++cc) widen_chunk(sRing + (tslot * 9 + cc) * C::kRawChunk, sConv + cc * C::kBfChunk);
        __syncthreads();
      }
      float s[C::kQKM][C::kQKNT][4];  // S over this warp's k-steps: rows qk_row0 + mi*16, keys of half kq
#pragma unroll
      for (int mi = 0; mi < C::kQKM; ++mi)
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][j][e] = 0.f;

      // Shared-memory address of chunk c of this tile (the widened copy for fp8): V chunks are K chunks 0..7.
      auto chunk_buf = [&](int c) -> uint32_t {
        return FP8 ? sConv + c * C::kBfChunk : sRing + (tslot * 9 + c) * C::kRawChunk;
      };

      uint32_t buf = 0;
#pragma unroll 1
      for (int c = 0; c < 9; ++c) {
        buf = chunk_buf(c);
        // ---- S[16 kQKM x BN/2] += Q[rows, this warp's k-steps of chunk c] K_c^T
#pragma unroll
        for (int kk = 0; kk < C::kQKKS; ++kk) {
          const int ks = C::kQKKS * dh + kk;
          uint32_t a[C::kQKM][4];
#pragma unroll
          for (int mi = 0; mi < C::kQKM; ++mi)
            ldsm_x4(a[mi], sQ + c * (kBM * 128) + swz(qk_row0 + mi * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
          for (int jj = 0; jj < C::kQKNT / 2; ++jj) {
            const int key = kq * (BN / 2) + jj * 16 + (lane & 7) + ((lane >> 4) << 3);
            uint32_t bq[4];
            ldsm_x4(bq, buf + swz(key, ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
            for (int mi = 0; mi < C::kQKM; ++mi) {
              mma_bf16(s[mi][2 * jj], a[mi], bq[0], bq[1]);
              mma_bf16(s[mi][2 * jj + 1], a[mi], bq[2], bq[3]);
            }
          }
        }
      }
      {
        float sk[C::kQKNT][4];  // full S of rows own0, own1 over key half kq
        // ---- the dh pair swaps 16-row blocks: this warp keeps block dh (rows own0, own1) with full sums
        __syncthreads();  // every warp is done reading chunk 8, whose buffer takes half of the exchange
        const uint32_t ex_off = ((rh * 2 + kq) * C::kQKNT * 4 * 32 + lane) * 4;
        const uint32_t ex_give = (dh ? sPu : buf) + ex_off, ex_take = (dh ? buf : sPu) + ex_off;
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(ex_give + (j * 4 + e) * 128),
                         "f"(dh ? s[0][j][e] : s[1][j][e]));
        __syncthreads();
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float other;
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(other) : "r"(ex_take + (j * 4 + e) * 128));
            sk[j][e] = (dh ? s[1][j][e] : s[0][j][e]) + other;
          }
        // ---- online softmax (log2 domain); tree mask only on tiles that reach the tree keys
        const int kbase = tile * BN + kq * (BN / 2);
        const bool masked = (tile + 1) * BN > tree_start;
        uint64_t bits[2] = {~0ull, ~0ull};  // read only on the last tiles: registers are scarce
        if (masked) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int row = rt * kBM + (e ? own1 : own0);
            if (row < rows) bits[e] = static_cast<uint64_t>(p.tree_bits[q0 + row / p.H]);
          }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) sk[j][e] *= p.scale_log2;
        if (masked) {  // one block the other tiles branch over
#pragma unroll
          for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = kbase + j * 8 + 2 * q4 + (e & 1);
              const int tk = key - tree_start;
              const bool vis = key < L && (tk < 0 || ((bits[e >> 1] >> tk) & 1ull));
              sk[j][e] = vis ? sk[j][e] : -INFINITY;
            }
        }
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], sk[j][e]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
          mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
        }
        if (q4 == 0) {
          red[kq * kBM + own0] = mx[0];
          red[kq * kBM + own1] = mx[1];
        }
        __syncthreads();  // also: every exchange read is done, so sP may be written
        float muse[2], alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // lazy rescaling (as in the decode kernel): the reference max m moves only when the tile's max exceeds it
          // by more than kRescaleSlack, so P <= 2^kRescaleSlack and most tiles leave O alone (alpha = 1); both key
          // halves see the same tile max, so they decide alike
          const float mt = fmaxf(mx[e], red[(kq ^ 1) * kBM + (e ? own1 : own0)]);
          alpha[e] = 1.f;
          if (mt > m[e] + kRescaleSlack) {  // false while mt = -inf; true for the first finite max (m = -inf)
            alpha[e] = fast_exp2(m[e] - mt);
            m[e] = mt;
            l[e] *= alpha[e];
          }
          muse[e] = m[e] == -INFINITY ? 0.f : m[e];  // fully masked so far: keep exp2 finite
          if (kq == 0 && q4 == 0) srow[e ? own1 : own0] = alpha[e];
        }
#pragma unroll
        for (int j = 0; j < C::kQKNT; ++j) {
          const float p0 = fast_exp2(sk[j][0] - muse[0]), p1 = fast_exp2(sk[j][1] - muse[0]);
          const float p2 = fast_exp2(sk[j][2] - muse[1]), p3 = fast_exp2(sk[j][3] - muse[1]);
          l[0] += p0 + p1;
          l[1] += p2 + p3;
          const int key = kq * (BN / 2) + j * 8 + 2 * q4;
          *reinterpret_cast<uint32_t*>(sP + own0 * C::kPStride + key) = pack_bf16(p0, p1);
          *reinterpret_cast<uint32_t*>(sP + own1 * C::kPStride + key) = pack_bf16(p2, p3);
        }
      }
      __syncthreads();  // sP and alpha written by the softmax
      uint32_t pa[C::kPVM][C::kPVKS][4];  // P of this warp's rows; and the rescale of its O rows by srow's alpha
#pragma unroll
      for (int mi = 0; mi < C::kPVM; ++mi) {
        const int pr = pv_row0 + mi * 16 + (lane & 15);
#pragma unroll
        for (int ks = 0; ks < C::kPVKS; ++ks)
          ldsm_x4(pa[mi][ks], sPu + pr * (C::kPStride * 2) + ((ks * 2 + (lane >> 4)) << 4));
        const float a0 = srow[pv_row0 + mi * 16 + g], a1 = srow[pv_row0 + mi * 16 + g + 8];
        if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f))
#pragma unroll
          for (int v = 0; v < 8; ++v)
#pragma unroll
            for (int nj = 0; nj < C::kPVNJ; ++nj) {
              o[v][mi][nj][0] *= a0;
              o[v][mi][nj][1] *= a0;
              o[v][mi][nj][2] *= a1;
              o[v][mi][nj][3] *= a1;
            }
      }
#pragma unroll
      for (int vc = 0; vc < 8; ++vc) {
        // ---- O[rows pv_row0.., (chunk vc, dims pv_d0..)] += P[rows, BN] V_vc
        buf = chunk_buf(vc);
#pragma unroll
        for (int ks = 0; ks < C::kPVKS; ++ks) {
          const int key = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
          for (int jj = 0; jj < C::kPVNJ / 2; ++jj) {
            uint32_t bv[4];
            ldsm_x4_t(bv, buf + swz(key, pv_d0 / 8 + jj * 2 + (lane >> 4)));
#pragma unroll
            for (int mi = 0; mi < C::kPVM; ++mi) {
              mma_bf16(o[vc][mi][2 * jj], pa[mi][ks], bv[0], bv[1]);
              mma_bf16(o[vc][mi][2 * jj + 1], pa[mi][ks], bv[2], bv[3]);
            }
          }
        }
      }
    }

    // ---- epilogue: full row sums (both key halves) -> 1/l per row, lse by the kq = 0 owner; then every warp
    // normalizes and writes its O block
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
      l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
    }
    __syncthreads();  // the last tile's readers of red / srow are done
    if (q4 == 0) {
      red[kq * kBM + own0] = l[0];
      red[kq * kBM + own1] = l[1];
    }
    __syncthreads();
    const int rstride = p.max_q * p.H;
    if (kq == 0 && q4 == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int lr = e ? own1 : own0;
        const float lt = l[e] + red[kBM + lr];
        srow[lr] = lt > 0.f ? p.kv_scale / lt : 0.f;
        const float lse2 = lt > 0.f ? m[e] + log2f(lt) : -INFINITY;
        const int row = rt * kBM + lr;
        if (row < rows) {
          if (slot < 0) {
            p.lse[(q0 + row / p.H) * p.lse_s0 + (row % p.H) * p.lse_s1] = lse2 * kLn2;
          } else {
            p.ws_lse[(int64_t)slot * rstride + row] = lse2;
          }
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < C::kPVM; ++mi)
#pragma unroll
      for (int eh = 0; eh < 2; ++eh) {
        const int lr = pv_row0 + mi * 16 + g + 8 * eh;
        const int row = rt * kBM + lr;
        if (row >= rows) continue;
        const float inv = srow[lr];
        const int node = row / p.H, head = row % p.H;
        const int64_t tok = q0 + node;
        if (slot < 0) {
          char* orow = reinterpret_cast<char*>(p.out) + (tok * p.out_s0 + head * p.out_s1) * 2;
#pragma unroll
          for (int vc = 0; vc < 8; ++vc)
#pragma unroll
            for (int nj = 0; nj < C::kPVNJ; ++nj) {
              const int d = vc * 64 + pv_d0 + nj * 8 + 2 * q4;
              const float x0 = o[vc][mi][nj][2 * eh] * inv, x1 = o[vc][mi][nj][2 * eh + 1] * inv;
              *reinterpret_cast<uint32_t*>(orow + d * 2) = pack_out(x0, x1, p.out_fp16);
            }
        } else {
          float* wrow = p.ws_o + ((int64_t)slot * rstride + row) * kDV;
#pragma unroll
          for (int vc = 0; vc < 8; ++vc)
#pragma unroll
            for (int nj = 0; nj < C::kPVNJ; ++nj) {
              const int d = vc * 64 + pv_d0 + nj * 8 + 2 * q4;
              *reinterpret_cast<float2*>(wrow + d) =
                  make_float2(o[vc][mi][nj][2 * eh] * inv, o[vc][mi][nj][2 * eh + 1] * inv);
            }
        }
      }
  }
#endif
}

template <bool FP8>
void launch_main(const MlaParams& p, cudaStream_t stream) {
  using C = KCfg<FP8>;
  launch_row_tiles<mla_tree_verify_kernel<FP8>>(p, C::kThreads, C::kSmem, stream);
}

}  // namespace

static_assert((KCfg<false>::kSmem > KCfg<true>::kSmem ? KCfg<false>::kSmem : KCfg<true>::kSmem) == kResidentVSmem,
              "kResidentVSmem (constants.MLA_RESIDENT_V_SMEM) is what the dispatch checks a GPU against");

void launch_mla_resident_v(const MlaParams& p, cudaStream_t stream) {
  if (p.kv_fp8) {
    launch_main<true>(p, stream);
  } else {
    launch_main<false>(p, stream);
  }
}

}  // namespace ddtree
