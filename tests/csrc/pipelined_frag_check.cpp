// Host harness for the portable pipelined kernel's layout and fragment addressing (csrc/mla_pipelined_layout.cuh):
// fills a ring stage through the kernel's loader map (coverage, and the one-address-plus-offsets form the kernel
// issues), Q's rope chunk and a P buffer at the kernel's offsets, then runs every warp's QK (latent k-steps from
// registers in the kernel's fragment order, rope ones from the chunk; both parities summed, as the pair exchange does)
// and PV with emulated ldmatrix / mma.m16n8k16 at the kernel's lane addresses, against direct products, with every
// ldmatrix phase checked for bank conflicts. Fragment semantics: frag_emul.h.
#include <cstdio>
#include <vector>

#include "frag_emul.h"
#include "mla_pipelined_layout.cuh"

using namespace ddtree::pipe;

static double Kval(int key, int d) { return static_cast<double>(((key * 7 + d * 13) % 23) - 11); }
static double Qval(int row, int d) { return static_cast<double>(((row * 5 + d * 3) % 17) - 8); }
static double Pval(int row, int key) { return static_cast<double>(((row * 3 + key * 11) % 7) - 3); }

// The ring stage as the 256 loader threads fill it: thread tid's unit k lands at kv_off(key, u0) + 2 k kChunk.
static void fill_stage(Smem& s) {
  std::vector<int> cover(kBN * kUnits, 0);
  for (int tid = 0; tid < 256; ++tid) {
    const int key = load_key(tid), u0 = load_unit(tid, 0);
    for (int k = 0; k < kLoadIters; ++k) {
      const int u = load_unit(tid, k);
      if (u >= kUnits) continue;
      const uint32_t off = kv_off(key, u);
      CHECK(off == kv_off(key, u0) + 2u * k * kChunk, "loader: unit %d of key %d is not 2k chunks past unit %d", u,
            key, u0);
      CHECK(off % 16 == 0 && off + 16 <= kTile, "loader offset %u", off);
      cover[key * kUnits + u]++;
      for (int e = 0; e < 8; ++e) s.put(off + 2 * e, Kval(key, 8 * u + e));
    }
  }
  for (int x = 0; x < kBN * kUnits; ++x) CHECK(cover[x] == 1, "key %d unit %d loaded %d times", x / kUnits,
                                               x % kUnits, cover[x]);
}

// QK of row group g: both parity warps' 18 steps, summed; against Q K^T over the 576 dims.
static void run_qk(const Smem& kv, const Smem& qpe, int g) {
  double s[2][32][4] = {};  // [n-tile][lane][accumulator], the two parities added into one (the pair's exchange)
  for (int c = 0; c < 2; ++c) {
    for (int i = 0; i < kQkSteps; ++i) {
      const int k = qk_kstep(i, c);
      Reg A[32][4];
      if (i < 16) {  // the kernel's registers: qa[i][e] = Q[row g8 + 8 (e & 1)][dims 16k + 2 q4 + 8 (e >> 1) ..]
        for (int t = 0; t < 32; ++t)
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * g + t / 4 + 8 * (e & 1), d = 16 * k + 2 * (t % 4) + 8 * (e >> 1);
            A[t][e] = {Qval(row, d), Qval(row, d + 1)};
          }
      } else {
        uint32_t aa[32];
        for (int t = 0; t < 32; ++t) aa[t] = rope_a_addr(t, g, c, i);
        ldsm_x4(qpe, aa, false, A, kRows * 128);
      }
      uint32_t ba[32];
      for (int t = 0; t < 32; ++t) ba[t] = qk_b_addr(t, c, i);
      Reg B[32][4];
      ldsm_x4(kv, ba, false, B, kTile);
      mma(s[0], A, B, 0);  // kernel: mma_bf16(s[0], a, bk[0], bk[1])
      mma(s[1], A, B, 1);  //         mma_bf16(s[1], a, bk[2], bk[3])
    }
  }
  for (int t = 0; t < 32; ++t)
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * g + t / 4 + 8 * (e >> 1), key = 8 * nt + 2 * (t % 4) + (e & 1);
        double ref = 0;
        for (int d = 0; d < 576; ++d) ref += Qval(row, d) * Kval(key, d);
        CHECK(s[nt][t][e] == ref, "QK g=%d lane=%d nt=%d e=%d: %g vs %g", g, t, nt, e, s[nt][t][e], ref);
      }
}

// PV of warp w: O[64 rows x dims 64w ..] from the P buffer and the stage's chunk w.
static void run_pv(const Smem& kv, const Smem& pbuf, int w) {
  double o[4][8][32][4] = {};
  for (int mi = 0; mi < 4; ++mi) {
    uint32_t pa_addr[32];
    for (int t = 0; t < 32; ++t) pa_addr[t] = p_a_addr(t, mi);
    Reg pa[32][4];
    ldsm_x4(pbuf, pa_addr, false, pa, kRows * kPStride * 2);
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t va[32];
      for (int t = 0; t < 32; ++t) va[t] = v_b_addr(t, w, jj);
      Reg bv[32][4];
      ldsm_x4(kv, va, true, bv, kTile);
      mma(o[mi][2 * jj], pa, bv, 0);      // kernel: mma_bf16(o[mi][2 jj], pa, bv[jj][0], bv[jj][1])
      mma(o[mi][2 * jj + 1], pa, bv, 1);  //         mma_bf16(o[mi][2 jj + 1], pa, bv[jj][2], bv[jj][3])
    }
  }
  for (int mi = 0; mi < 4; ++mi)
    for (int nt = 0; nt < 8; ++nt)
      for (int t = 0; t < 32; ++t)
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * mi + t / 4 + 8 * (e >> 1), dim = 64 * w + 8 * nt + 2 * (t % 4) + (e & 1);
          double ref = 0;
          for (int key = 0; key < kBN; ++key) ref += Pval(row, key) * Kval(key, dim);
          CHECK(o[mi][nt][t][e] == ref, "PV w=%d mi=%d nt=%d lane=%d e=%d: %g vs %g", w, mi, nt, t, e,
                o[mi][nt][t][e], ref);
        }
}

int main() {
  Smem kv(kTile), qpe(kRows * 128), pbuf(kRows * kPStride * 2);
  fill_stage(kv);
  for (int r = 0; r < kRows; ++r)  // Q's rope dims, as row_tile::load_q_rope stores them (swizzled 16-byte units)
    for (int u = 0; u < 8; ++u)
      for (int e = 0; e < 8; ++e) qpe.put(swz128(r, u) + 2 * e, Qval(r, 512 + 8 * u + e));
  // P as the softmax stores it: row lr, keys 8 j + 2 q4 (+1) at p_off(lr, 0) + 2 (8 j + 2 q4) (a 32-bit store)
  for (int lr = 0; lr < kRows; ++lr)
    for (int j = 0; j < 2; ++j)
      for (int q4 = 0; q4 < 4; ++q4)
        for (int e = 0; e < 2; ++e) {
          const int key = 8 * j + 2 * q4 + e;
          CHECK(p_off(lr, key) == p_off(lr, 0) + 2u * key, "P row %d is not contiguous", lr);
          pbuf.put(p_off(lr, key), Pval(lr, key));
        }
  for (int g = 0; g < 4; ++g) run_qk(kv, qpe, g);
  for (int w = 0; w < 8; ++w) run_pv(kv, pbuf, w);
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
