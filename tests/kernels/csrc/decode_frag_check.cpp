// Host harness for the decode kernel's layout and fragment addressing (csrc/variants/decode_layout.cuh): fills a warp's
// slices through the kernel's unit maps (bf16 loads, fp8 loads + widening), runs its QK and PV with emulated
// ldmatrix (.x4, .x4.trans) and mma.m16n8k16 at the kernel's lane addresses, and compares with direct products;
// also checks coverage of the unit maps, bank-conflict freedom of every ldmatrix phase, and the output dim map.
// Fragment semantics: frag_emul.h (the PTX ISA's).
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "frag_emul.h"
#include "variants/decode_layout.cuh"

using namespace ddtree::dec;

static double Kval(int r, int d) { return static_cast<double>(((r * 7 + d * 13) % 23) - 11); }
static double Qval(int r, int d) { return static_cast<double>(((r * 5 + d * 3) % 17) - 8); }
static double Pval(int r, int k) { return static_cast<double>(((r * 3 + k * 11) % 7) - 3); }

static void fill_bf16(Smem& s, int w, double (*val)(int, int)) {
  for (int i = 0; i < kUnitsBf; ++i) {
    int r, dim;
    uint32_t off;
    bf16_unit(i, w, r, off, dim);
    CHECK(off % 16 == 0 && off + 16 <= kSliceBf, "bf16 unit offset %u", off);
    for (int e = 0; e < 8; ++e) s.put(off + 2 * e, val(r, dim + e));
  }
}

static void fill_fp8_widened(Smem& s, int w) {
  std::vector<double> raw(kSliceFp8, 1e300);
  std::vector<int> rawn(kSliceFp8, 0);
  for (int i = 0; i < kUnitsFp8; ++i) {  // cp.async: byte column dim + e of key r -> raw_off + e
    int r, dim;
    uint32_t off, d0, d1;
    fp8_unit(i, w, r, off, dim, d0, d1);
    CHECK(off % 16 == 0 && off + 16 <= kSliceFp8, "fp8 raw offset %u", off);
    for (int e = 0; e < 16; ++e) {
      raw[off + e] = Kval(r, dim + e);
      rawn[off + e]++;
    }
  }
  for (int b = 0; b < kSliceFp8; ++b) CHECK(rawn[b] == 1, "fp8 raw byte %d written %d times", b, rawn[b]);
  for (int i = 0; i < kUnitsFp8; ++i) {  // widening: raw bytes 0..7 -> d0, 8..15 -> d1
    int r, dim;
    uint32_t off, d0, d1;
    fp8_unit(i, w, r, off, dim, d0, d1);
    for (int e = 0; e < 8; ++e) {
      s.put(d0 + 2 * e, raw[off + e]);
      s.put(d1 + 2 * e, raw[off + 8 + e]);
    }
  }
}

static void run_warp(int w, bool fp8) {
  Smem q(kSliceBf), k(kSliceBf);
  fill_bf16(q, w, Qval);
  if (fp8) fill_fp8_widened(k, w);
  else fill_bf16(k, w, Kval);
  for (size_t j = 0; j < k.written.size(); ++j) CHECK(k.written[j] == 1, "slice element %zu written %d times", j,
                                                       k.written[j]);
  // ---- QK over the warp's 9 k-steps
  double s[2][32][4] = {};
  for (int kk = 0; kk < kKSteps; ++kk) {
    uint32_t aa[32], ba[32];
    for (int t = 0; t < 32; ++t) {
      aa[t] = qa_addr(t, kk);
      ba[t] = kb_addr(t, kk);
    }
    Reg A[32][4], Bq[32][4];
    ldsm_x4(q, aa, false, A, kSliceBf);
    ldsm_x4(k, ba, false, Bq, kSliceBf);
    mma(s[0], A, Bq, 0);  // kernel: mma_bf16(s[0], qa[kk], bq[0], bq[1])
    mma(s[1], A, Bq, 1);  //         mma_bf16(s[1], qa[kk], bq[2], bq[3])
  }
  std::vector<int> dims;
  for (int d = 0; d < 128; ++d) dims.push_back(128 * w + d);
  for (int d = 0; d < 16; ++d) dims.push_back(512 + 16 * w + d);
  for (int t = 0; t < 32; ++t)
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int row = t / 4 + 8 * (e >> 1), key = 8 * nt + 2 * (t % 4) + (e & 1);
        double ref = 0;
        for (int d : dims) ref += Qval(row, d) * Kval(key, d);
        CHECK(s[nt][t][e] == ref, "QK w=%d fp8=%d lane=%d nt=%d e=%d: %g vs %g", w, fp8, t, nt, e, s[nt][t][e], ref);
      }
  // ---- PV: P (C layout of S) packed as the kernel packs it, V from the slice's latent part
  Reg pa[32][4];
  for (int t = 0; t < 32; ++t) {
    const int g = t / 4, q4 = t % 4;
    double sv[2][4];
    for (int nt = 0; nt < 2; ++nt)
      for (int e = 0; e < 4; ++e) sv[nt][e] = Pval(g + 8 * (e >> 1), 8 * nt + 2 * q4 + (e & 1));
    pa[t][0] = {sv[0][0], sv[0][1]};  // kernel: pa[0] = pack(p00, p01)
    pa[t][1] = {sv[0][2], sv[0][3]};  // pa[1] = pack(p02, p03)
    pa[t][2] = {sv[1][0], sv[1][1]};  // pa[2] = pack(p10, p11)
    pa[t][3] = {sv[1][2], sv[1][3]};  // pa[3] = pack(p12, p13)
  }
  double o[kVTiles][32][4] = {};
  for (int jj = 0; jj < kVTiles / 2; ++jj) {
    uint32_t va[32];
    for (int t = 0; t < 32; ++t) va[t] = vb_addr(t, jj);
    Reg Bv[32][4];
    ldsm_x4(k, va, true, Bv, kSliceBf);
    mma(o[2 * jj], pa, Bv, 0);  // kernel: mma_bf16(o[2 * jj], pa, bv[0], bv[1])
    mma(o[2 * jj + 1], pa, Bv, 1);  //         mma_bf16(o[2 * jj + 1], pa, bv[2], bv[3])
  }
  for (int j = 0; j < kVTiles; ++j)
    for (int t = 0; t < 32; ++t)
      for (int e = 0; e < 4; ++e) {
        const int row = t / 4 + 8 * (e >> 1), dim = o_dim(w, j, t % 4, e);
        double ref = 0;
        for (int key = 0; key < 16; ++key) ref += Pval(row, key) * Kval(key, dim);
        CHECK(o[j][t][e] == ref, "PV w=%d fp8=%d j=%d lane=%d e=%d: %g vs %g", w, fp8, j, t, e, o[j][t][e], ref);
      }
}

int main() {
  // unit maps: every (row, dim) of the 576 loaded by exactly one warp and unit
  std::vector<int> cover(16 * 576, 0), cover8(16 * 576, 0);
  for (int w = 0; w < 4; ++w) {
    for (int i = 0; i < kUnitsBf; ++i) {
      int r, dim;
      uint32_t off;
      bf16_unit(i, w, r, off, dim);
      CHECK(r >= 0 && r < 16 && dim >= 0 && dim + 8 <= 576 && dim % 8 == 0, "bf16 unit %d", i);
      for (int e = 0; e < 8; ++e) cover[r * 576 + dim + e]++;
    }
    for (int i = 0; i < kUnitsFp8; ++i) {
      int r, dim;
      uint32_t off, d0, d1;
      fp8_unit(i, w, r, off, dim, d0, d1);
      CHECK(r >= 0 && r < 16 && dim >= 0 && dim + 16 <= 576 && dim % 16 == 0, "fp8 unit %d", i);
      for (int e = 0; e < 16; ++e) cover8[r * 576 + dim + e]++;
    }
  }
  for (int x = 0; x < 16 * 576; ++x) {
    CHECK(cover[x] == 1, "bf16 coverage of row %d dim %d: %d", x / 576, x % 576, cover[x]);
    CHECK(cover8[x] == 1, "fp8 coverage of row %d dim %d: %d", x / 576, x % 576, cover8[x]);
  }
  // output dims: a partition of 512
  std::vector<int> od(512, 0);
  for (int w = 0; w < 4; ++w)
    for (int j = 0; j < kVTiles; ++j)
      for (int q4 = 0; q4 < 4; ++q4)
        for (int e = 0; e < 2; ++e) od[o_dim(w, j, q4, e)]++;
  for (int d = 0; d < 512; ++d) CHECK(od[d] == 1, "output dim %d covered %d times", d, od[d]);
  // S exchange slots (tiles of 1 and 2 slices): distinct float4s inside 2 buffers, consecutive across the lanes
  for (int nk : {2, 4}) {
    std::set<int> xo;
    for (int xb = 0; xb < 2; ++xb)
      for (int w = 0; w < 4; ++w)
        for (int k = 0; k < nk; ++k)
          for (int t = 0; t < 32; ++t) {
            const int off = xs_off(xb, w, k, t, nk);
            CHECK(off % 4 == 0 && off + 4 <= 2 * 4 * 32 * 4 * nk, "xs offset %d", off);
            CHECK(t == 0 || off == xs_off(xb, w, k, t - 1, nk) + 4, "xs lanes not consecutive");
            xo.insert(off);
          }
    CHECK(static_cast<int>(xo.size()) == 2 * 4 * nk * 32, "xs offsets not distinct");
  }
  for (int w = 0; w < 4; ++w) {
    run_warp(w, false);
    run_warp(w, true);
  }
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
