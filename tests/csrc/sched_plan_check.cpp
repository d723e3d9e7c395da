// Host harness for the line planner (csrc/mla_sched_plan.cuh): runs the device kernel's four phases with the very
// same functions, emulating its 512 threads (same chunking, prefix sums done sequentially), on random and edge
// cases, and checks every invariant the decode kernel and the combine rely on. Exit code 0 = all good.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "mla_sched_plan.cuh"

using namespace ddtree::plan;

constexpr int kNT = 512;  // mla_sched_line_kernel's block
constexpr int kOV = 5;    // kSchedOverhead

static int fail(const char* what, int B, int P, int bn) {
  std::printf("FAIL: %s (B=%d P=%d bn=%d)\n", what, B, P, bn);
  return 1;
}

static int check(const std::vector<int>& seq, const std::vector<int>& qsl, int P, int bn, int min_tiles,
                 double* imbalance) {
  const int B = static_cast<int>(seq.size());
  std::vector<int> sK(B), sC(B), sS(B), npc(B), slot0(B);
  std::vector<int> part_begin(P + 1, -7), preq(B + P, -7), pt0(B + P, -7), pt1(B + P, -7), pslot(B + P, -7);
  const int chunk = (B + kNT - 1) / kNT;
  std::vector<int> csum(kNT), np(kNT), ns(kNT), b0v(kNT), b1v(kNT);
  for (int t = 0; t < kNT; ++t) {
    b0v[t] = std::min(B, t * chunk);
    b1v[t] = std::min(B, b0v[t] + chunk);
    csum[t] = chunk_cost(b0v[t], b1v[t], seq.data(), qsl.data(), bn, kOV, sK.data());
  }
  int total = 0;
  std::vector<int> cbase(kNT);
  for (int t = 0; t < kNT; ++t) { cbase[t] = total; total += csum[t]; }
  const int per = part_len(total, P, kOV, min_tiles);
  if (per < kOV + min_tiles || (total > 0 && static_cast<long long>(per) * P < total)) return fail("per", B, P, bn);
  for (int t = 0; t < kNT; ++t) chunk_count(b0v[t], b1v[t], cbase[t], kOV, per, sK.data(), sC.data(), np[t], ns[t]);
  int np_total = 0, ns_total = 0;
  std::vector<int> pbase(kNT), sbase(kNT);
  for (int t = 0; t < kNT; ++t) {
    pbase[t] = np_total;
    np_total += np[t];
    sbase[t] = ns_total;
    ns_total += ns[t];
  }
  for (int t = 0; t < kNT; ++t)
    chunk_write(b0v[t], b1v[t], pbase[t], sbase[t], kOV, per, sK.data(), sC.data(), sS.data(), npc.data(),
                slot0.data());
  for (int p = 0; p < P; ++p)
    plan_part(p, B, total, per, kOV, np_total, sK.data(), sC.data(), sS.data(), slot0.data(), part_begin.data(),
              preq.data(), pt0.data(), pt1.data(), pslot.data());
  part_begin[P] = np_total;

  // ---- invariants
  if (np_total > B + P) return fail("more pieces than B + P", B, P, bn);
  const int max_slots = std::min(B + P, 2 * P);
  if (ns_total > max_slots) return fail("more slots than mla_num_slots", B, P, bn);
  if (part_begin[0] != 0) return fail("part_begin[0] != 0", B, P, bn);
  for (int p = 0; p < P; ++p)
    if (part_begin[p] < 0 || part_begin[p] > part_begin[p + 1]) return fail("part_begin not monotone", B, P, bn);
  std::vector<int> owner(np_total, -1);
  for (int p = 0; p < P; ++p)
    for (int i = part_begin[p]; i < part_begin[p + 1]; ++i) owner[i] = p;
  for (int i = 0; i < np_total; ++i)
    if (owner[i] < 0) return fail("piece in no part", B, P, bn);
  for (int i = 0; i < np_total; ++i) {
    if (preq[i] < 0 || preq[i] >= B) return fail("piece request out of range / unwritten", B, P, bn);
    if (!(pt0[i] >= 0 && pt0[i] < pt1[i] && pt1[i] <= sK[preq[i]])) return fail("bad tile range", B, P, bn);
    if (i > 0 && preq[i] < preq[i - 1]) return fail("pieces not ordered by request", B, P, bn);
  }
  std::vector<char> slot_used(std::max(ns_total, 1), 0);
  int expect_id = 0;
  for (int b = 0; b < B; ++b) {
    const int n = qsl[b + 1] - qsl[b];
    const int k = (n > 0 && seq[b] > 0) ? (seq[b] + bn - 1) / bn : 0;
    if (sK[b] != k) return fail("tiles", B, P, bn);
    if (k == 0 && npc[b] != 0) return fail("empty request got pieces", B, P, bn);
    if (k > 0 && npc[b] < 1) return fail("request without pieces", B, P, bn);
    if (sS[b] != expect_id) return fail("first piece id", B, P, bn);
    int t = 0;
    for (int i = 0; i < npc[b]; ++i) {
      const int id = sS[b] + i;
      if (preq[id] != b) return fail("piece of another request", B, P, bn);
      if (pt0[id] != t) return fail("tile ranges not contiguous", B, P, bn);
      t = pt1[id];
      if (i > 0 && owner[id] <= owner[id - 1]) return fail("request pieces not in increasing parts", B, P, bn);
      if (npc[b] == 1) {
        if (pslot[id] != -1 || slot0[b] != -1) return fail("single piece with a slot", B, P, bn);
      } else {
        if (pslot[id] != slot0[b] + i) return fail("slots not consecutive", B, P, bn);
        if (pslot[id] < 0 || pslot[id] >= ns_total || slot_used[pslot[id]]) return fail("slot reuse", B, P, bn);
        slot_used[pslot[id]] = 1;
      }
    }
    if (t != k) return fail("tiles not covered", B, P, bn);
    expect_id += npc[b];
  }
  if (expect_id != np_total) return fail("piece count", B, P, bn);
  // balance: cost of a part = its tiles + OV per piece, against the ideal (all tiles + OV per request) / P
  int worst = 0;
  for (int p = 0; p < P; ++p) {
    int c = 0;
    for (int i = part_begin[p]; i < part_begin[p + 1]; ++i) c += pt1[i] - pt0[i] + kOV;
    worst = std::max(worst, c);
  }
  if (worst > per + 2 * kOV && worst > 0) {
    // a part holds at most per line units; each extra piece it starts mid-request costs one more OV
    int extra = 0;
    for (int p = 0; p < P; ++p) extra = std::max(extra, part_begin[p + 1] - part_begin[p]);
    if (worst > per + kOV * extra) return fail("part cost beyond per + OV per piece", B, P, bn);
  }
  if (imbalance) *imbalance = total > 0 ? worst / (static_cast<double>(total) / P) : 1.0;
  return 0;
}

int main() {
  std::mt19937 rng(1234);
  int bad = 0, cases = 0;
  double worst_imb = 0.0;
  auto run = [&](const std::vector<int>& seq, const std::vector<int>& ql, int P, int bn) {
    std::vector<int> qsl(seq.size() + 1, 0);
    for (size_t b = 0; b < seq.size(); ++b) qsl[b + 1] = qsl[b] + ql[b];
    double imb = 0;
    bad += check(seq, qsl, P, bn, 1, nullptr);
    bad += check(seq, qsl, P, bn, 8, &imb);  // the decode planner's minimum
    cases += 2;
    if (seq.size() == 1 && P >= 8 && seq[0] > 64 * P * bn) worst_imb = std::max(worst_imb, imb);
  };
  // edge cases
  run({1}, {1}, 1, 16);
  run({0}, {0}, 5, 16);
  run({7}, {0}, 5, 16);
  run({0}, {1}, 5, 16);
  run({131072}, {1}, 396, 16);
  run({131072}, {1}, 1, 16);
  run({16384}, std::vector<int>(1, 1), 264, 16);
  run(std::vector<int>(16, 16384), std::vector<int>(16, 1), 396, 16);
  run(std::vector<int>(64, 4096), std::vector<int>(64, 1), 396, 16);
  run(std::vector<int>(8192, 100), std::vector<int>(8192, 1), 396, 16);
  run(std::vector<int>(8192, 100), std::vector<int>(8192, 1), 1, 64);
  run({5, 0, 1000, 0, 0, 17}, {1, 0, 2, 0, 0, 64}, 396, 16);
  run({5, 1000, 7, 9, 4113}, {0, 2, 0, 0, 1}, 3, 32);
  // random
  for (int it = 0; it < 20000; ++it) {
    const int B = 1 + rng() % (it % 10 == 0 ? 3000 : 70);
    const int P = 1 + rng() % 700;
    const int bn = 16 << (rng() % 3);
    std::vector<int> seq(B), ql(B);
    const int lmax = (rng() % 4 == 0) ? 200 : (rng() % 3 == 0 ? 140000 : 20000);
    for (int b = 0; b < B; ++b) {
      ql[b] = rng() % 5 == 0 ? 0 : 1 + rng() % 64;
      seq[b] = rng() % 20 == 0 ? 0 : std::max(ql[b], static_cast<int>(rng() % lmax));
    }
    run(seq, ql, P, bn);
  }
  std::printf("%d cases, %d failed; single long request: worst part / ideal = %.3f\n", cases, bad, worst_imb);
  return bad == 0 ? 0 : 1;
}
