// Host harness for the split-KV line plan of the decode kernel (csrc/scheduling/sched_plan.cuh). Two planners of the same
// plan, on random and edge cases:
// - the reference: the global line planner that ran as its own kernel (mla_sched_line_kernel) before each CTA of the
//   decode kernel planned its own part. Its four phases are kept here as it ran them (512 threads' chunks, prefix
//   sums done sequentially) and its output is checked against every invariant the kernel and the combine rely on;
// - the per-part derivation the decode kernel runs (part_plan and the piece walk in variants/decode.cu), with the
//   very same header functions, emulating its 128 threads: their request ranges, the warp scans and warp sums of the
//   two block scans, the owner's cursor, the walk of every part, CTA (0, 0)'s zeros for requests without tiles.
// Every part must walk exactly the reference's pieces of that part, in order (request, tile range, slot), and
// req_npieces / req_slot0 must equal the reference's for every request, each written exactly once. Exit code 0 = all
// good.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "scheduling/sched_plan.cuh"

using namespace ddtree::plan;

constexpr int kOV = 5;  // kSchedOverhead

namespace ref {  // the global line planner (mla_sched_line_kernel and its four phases)

constexpr int kNT = 512;  // its block

// Phase 1 (requests [b0, b1) of one thread): tiles per request into sK; returns the chunk's line length.
int chunk_cost(int b0, int b1, const int* seq_lens, const int* qsl, int bn, int ov, int* sK) {
  int c = 0;
  for (int b = b0; b < b1; ++b) {
    const int k = req_tiles(qsl[b + 1] - qsl[b], seq_lens[b], bn);
    sK[b] = k;
    c += req_cost(k, ov);
  }
  return c;
}

// Phase 2: line starts into sC (cbase: the chunk's first line position); piece and slot counts of the chunk.
void chunk_count(int b0, int b1, int cbase, int ov, int per, const int* sK, int* sC, int& npieces, int& nslots) {
  int c = cbase;
  npieces = 0;
  nslots = 0;
  for (int b = b0; b < b1; ++b) {
    const int k = sK[b];
    sC[b] = c;
    if (k > 0) {
      const int n = (c + ov + k - 1) / per - (c + ov) / per + 1;
      npieces += n;
      nslots += n > 1 ? n : 0;
    }
    c += req_cost(k, ov);
  }
}

// Phase 3: first piece (sS), piece count and first slot of every request of the chunk.
void chunk_write(int b0, int b1, int pbase, int sbase, int ov, int per, const int* sK, const int* sC, int* sS,
                 int* req_npieces, int* req_slot0) {
  for (int b = b0; b < b1; ++b) {
    const int k = sK[b], c = sC[b];
    const int n = k > 0 ? (c + ov + k - 1) / per - (c + ov) / per + 1 : 0;
    sS[b] = pbase;
    req_npieces[b] = n;
    req_slot0[b] = n > 1 ? sbase : -1;
    pbase += n;
    if (n > 1) sbase += n;
  }
}

// Phase 4 (one part): its pieces and part_begin[p]. total = line length, np_total = number of pieces.
void plan_part(int p, int B, int total, int per, int ov, int np_total, const int* sK, const int* sC, const int* sS,
               const int* req_slot0, int* part_begin, int* piece_req, int* piece_t0, int* piece_t1, int* piece_slot) {
  const int x = p * per;
  if (x >= total) {
    part_begin[p] = np_total;
    return;
  }
  const int hi = x + per < total ? x + per : total;
  // the request whose line range holds x: the largest b with C_b <= x (it has tiles)
  int lo = 0, up = B - 1;
  while (lo < up) {
    const int mid = (lo + up + 1) >> 1;
    if (sC[mid] <= x) lo = mid;
    else up = mid - 1;
  }
  bool first = true;
  for (int b = lo; b < B; ++b) {
    const int k = sK[b];
    if (k == 0) continue;
    const int s0 = sC[b] + ov;  // line position of tile 0
    if (s0 >= hi) break;
    const int i = p - s0 / per;  // index of this piece within the request
    const int id = sS[b] + i;
    if (first) {
      part_begin[p] = id;
      first = false;
    }
    const int t0 = x > s0 ? x - s0 : 0;
    const int t1 = hi - s0 < k ? hi - s0 : k;
    piece_req[id] = b;
    piece_t0[id] = t0;
    piece_t1[id] = t1;
    const int slot0 = req_slot0[b];
    piece_slot[id] = slot0 < 0 ? -1 : slot0 + i;
  }
}

}  // namespace ref

struct Plan {  // the reference's output
  int per = 0, total = 0, np_total = 0, ns_total = 0;
  std::vector<int> sK, part_begin, preq, pt0, pt1, pslot, npc, slot0;
};

static int fail(const char* what, int B, int P, int bn) {
  std::printf("FAIL: %s (B=%d P=%d bn=%d)\n", what, B, P, bn);
  return 1;
}

static Plan reference(const std::vector<int>& seq, const std::vector<int>& qsl, int P, int bn, int min_tiles) {
  const int B = static_cast<int>(seq.size());
  const int kNT = ref::kNT;
  Plan r;
  r.sK.assign(B, 0);
  std::vector<int> sC(B), sS(B);
  r.npc.assign(B, -7);
  r.slot0.assign(B, -7);
  r.part_begin.assign(P + 1, -7);
  r.preq.assign(B + P, -7);
  r.pt0.assign(B + P, -7);
  r.pt1.assign(B + P, -7);
  r.pslot.assign(B + P, -7);
  const int chunk = (B + kNT - 1) / kNT;
  std::vector<int> csum(kNT), np(kNT), ns(kNT), b0v(kNT), b1v(kNT), cbase(kNT), pbase(kNT), sbase(kNT);
  for (int t = 0; t < kNT; ++t) {
    b0v[t] = std::min(B, t * chunk);
    b1v[t] = std::min(B, b0v[t] + chunk);
    csum[t] = ref::chunk_cost(b0v[t], b1v[t], seq.data(), qsl.data(), bn, kOV, r.sK.data());
  }
  for (int t = 0; t < kNT; ++t) {
    cbase[t] = r.total;
    r.total += csum[t];
  }
  r.per = part_len(r.total, P, kOV, min_tiles);
  for (int t = 0; t < kNT; ++t)
    ref::chunk_count(b0v[t], b1v[t], cbase[t], kOV, r.per, r.sK.data(), sC.data(), np[t], ns[t]);
  for (int t = 0; t < kNT; ++t) {
    pbase[t] = r.np_total;
    r.np_total += np[t];
    sbase[t] = r.ns_total;
    r.ns_total += ns[t];
  }
  for (int t = 0; t < kNT; ++t)
    ref::chunk_write(b0v[t], b1v[t], pbase[t], sbase[t], kOV, r.per, r.sK.data(), sC.data(), sS.data(), r.npc.data(),
                     r.slot0.data());
  for (int p = 0; p < P; ++p)
    ref::plan_part(p, B, r.total, r.per, kOV, r.np_total, r.sK.data(), sC.data(), sS.data(), r.slot0.data(),
                   r.part_begin.data(), r.preq.data(), r.pt0.data(), r.pt1.data(), r.pslot.data());
  r.part_begin[P] = r.np_total;
  return r;
}

// The reference plan's invariants (what the decode kernel and the combine rely on); imbalance: worst part / ideal.
static int check_reference(const Plan& r, const std::vector<int>& seq, const std::vector<int>& qsl, int P, int bn,
                           int min_tiles, double* imbalance) {
  const int B = static_cast<int>(seq.size());
  const int per = r.per, total = r.total, np_total = r.np_total, ns_total = r.ns_total;
  if (per < kOV + min_tiles || (total > 0 && static_cast<long long>(per) * P < total)) return fail("per", B, P, bn);
  if (np_total > B + P) return fail("more pieces than B + P", B, P, bn);
  const int max_slots = std::min(B + P, 2 * P);
  if (ns_total > max_slots) return fail("more slots than mla_num_slots", B, P, bn);
  if (r.part_begin[0] != 0) return fail("part_begin[0] != 0", B, P, bn);
  for (int p = 0; p < P; ++p)
    if (r.part_begin[p] < 0 || r.part_begin[p] > r.part_begin[p + 1]) return fail("part_begin not monotone", B, P, bn);
  std::vector<int> owner(np_total, -1);
  for (int p = 0; p < P; ++p)
    for (int i = r.part_begin[p]; i < r.part_begin[p + 1]; ++i) owner[i] = p;
  for (int i = 0; i < np_total; ++i)
    if (owner[i] < 0) return fail("piece in no part", B, P, bn);
  for (int i = 0; i < np_total; ++i) {
    if (r.preq[i] < 0 || r.preq[i] >= B) return fail("piece request out of range / unwritten", B, P, bn);
    if (!(r.pt0[i] >= 0 && r.pt0[i] < r.pt1[i] && r.pt1[i] <= r.sK[r.preq[i]])) return fail("bad tile range", B, P, bn);
    if (i > 0 && r.preq[i] < r.preq[i - 1]) return fail("pieces not ordered by request", B, P, bn);
  }
  std::vector<char> slot_used(std::max(ns_total, 1), 0);
  int expect_id = 0;
  for (int b = 0; b < B; ++b) {
    const int n = qsl[b + 1] - qsl[b];
    const int k = (n > 0 && seq[b] > 0) ? (seq[b] + bn - 1) / bn : 0;
    if (r.sK[b] != k) return fail("tiles", B, P, bn);
    if (k == 0 && r.npc[b] != 0) return fail("empty request got pieces", B, P, bn);
    if (k > 0 && r.npc[b] < 1) return fail("request without pieces", B, P, bn);
    int t = 0;
    for (int i = 0; i < r.npc[b]; ++i) {
      const int id = expect_id + i;
      if (r.preq[id] != b) return fail("piece of another request", B, P, bn);
      if (r.pt0[id] != t) return fail("tile ranges not contiguous", B, P, bn);
      t = r.pt1[id];
      if (i > 0 && owner[id] <= owner[id - 1]) return fail("request pieces not in increasing parts", B, P, bn);
      if (r.npc[b] == 1) {
        if (r.pslot[id] != -1 || r.slot0[b] != -1) return fail("single piece with a slot", B, P, bn);
      } else {
        if (r.pslot[id] != r.slot0[b] + i) return fail("slots not consecutive", B, P, bn);
        if (r.pslot[id] < 0 || r.pslot[id] >= ns_total || slot_used[r.pslot[id]]) return fail("slot reuse", B, P, bn);
        slot_used[r.pslot[id]] = 1;
      }
    }
    if (t != k) return fail("tiles not covered", B, P, bn);
    expect_id += r.npc[b];
  }
  if (expect_id != np_total) return fail("piece count", B, P, bn);
  // balance: cost of a part = its tiles + OV per piece, against the ideal (all tiles + OV per request) / P
  int worst = 0;
  for (int p = 0; p < P; ++p) {
    int c = 0;
    for (int i = r.part_begin[p]; i < r.part_begin[p + 1]; ++i) c += r.pt1[i] - r.pt0[i] + kOV;
    worst = std::max(worst, c);
  }
  if (worst > per + 2 * kOV && worst > 0) {
    // a part holds at most per line units; each extra piece it starts mid-request costs one more OV
    int extra = 0;
    for (int p = 0; p < P; ++p) extra = std::max(extra, r.part_begin[p + 1] - r.part_begin[p]);
    if (worst > per + kOV * extra) return fail("part cost beyond per + OV per piece", B, P, bn);
  }
  if (imbalance) *imbalance = total > 0 ? worst / (static_cast<double>(total) / P) : 1.0;
  return 0;
}

// The decode kernel's per-part derivation (part_plan + the piece walk of mla_decode_verify_kernel), every part p of
// the launch, against the reference plan r.
constexpr int kThreads = 128, kWarps = 4;  // kDecThreads

// Exclusive prefix and total of v over the block, as part_plan forms them: each warp's inclusive scan, its lane 31's
// sum in the warp-sum array, the sums of the warps before added after the barrier.
static void block_scan(const std::vector<int>& v, std::vector<int>& incl, std::vector<int>& excl, int& total) {
  int wsum[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    int s = 0;
    for (int l = 0; l < 32; ++l) {
      s += v[32 * w + l];
      incl[32 * w + l] = s;
    }
    wsum[w] = s;
  }
  total = 0;
  for (int w = 0; w < kWarps; ++w) total += wsum[w];
  for (int t = 0; t < kThreads; ++t) {
    int before = 0;
    for (int w = 0; w < t / 32; ++w) before += wsum[w];
    excl[t] = incl[t] - v[t] + before;
  }
}

static int check_fused(const Plan& r, const std::vector<int>& seq, const std::vector<int>& qsl, int P, int bn,
                       int min_tiles, std::mt19937& sample, long long* pieces_checked) {
  const int B = static_cast<int>(seq.size());
  const int chunk = (B + kThreads - 1) / kThreads;
  std::vector<int> b0(kThreads), b1(kThreads), cost(kThreads), cincl(kThreads), cbase(kThreads);
  std::vector<int> ns(kThreads), gincl(kThreads), gbase(kThreads);
  std::vector<int> npieces(B, -7), slot0(B, -7), writes(B, 0);
  // Scan 1 and the slot counts of scan 2 do not depend on the part: every CTA computes the same from the same inputs
  // with the same functions, so they are computed once here (as CTA (0, 0), which also zeroes the requests without
  // tiles). Per part, only the cursor depends on x: range_slots runs again for the thread whose line range holds x,
  // and for all threads on a sample of parts, which must find exactly that one owner.
  for (int t = 0; t < kThreads; ++t) {
    b0[t] = std::min(B, t * chunk);
    b1[t] = std::min(B, b0[t] + chunk);
    cost[t] = range_cost(b0[t], b1[t], seq.data(), qsl.data(), bn, kOV, npieces.data(), slot0.data());
  }
  for (int b = 0; b < B; ++b) writes[b] += npieces[b] != -7;
  int total = 0;
  block_scan(cost, cincl, cbase, total);
  if (total != r.total) return fail("fused: line length", B, P, bn);
  const int per = part_len(total, P, kOV, min_tiles);
  if (per != r.per) return fail("fused: per", B, P, bn);
  PartCursor none{-1, 0, 0, 0};
  for (int t = 0; t < kThreads; ++t)
    ns[t] = range_slots(b0[t], b1[t], cbase[t], -1, per, seq.data(), qsl.data(), bn, kOV, none);
  if (none.b != -1) return fail("fused: an owner of x = -1", B, P, bn);
  int ns_total = 0;
  block_scan(ns, gincl, gbase, ns_total);
  if (ns_total != r.ns_total) return fail("fused: slot count", B, P, bn);
  for (int part = 0; part < P; ++part) {
    const int x = part * per;
    // ---- the owner of x publishes the cursor (its g, g_next + the slots of the threads before it)
    int owner = -1;
    for (int t = 0; t < kThreads; ++t)
      if (cbase[t] <= x && x < cbase[t] + cost[t]) owner = t;
    PartCursor own{-1, 0, 0, 0};
    if (owner >= 0 && range_slots(b0[owner], b1[owner], cbase[owner], x, per, seq.data(), qsl.data(), bn, kOV, own) !=
                          ns[owner])
      return fail("fused: slot count depends on x", B, P, bn);
    if (part == 0 || part == P - 1 || sample() % 16 == 0) {  // all threads: no other owner
      for (int t = 0; t < kThreads; ++t) {
        PartCursor c{-1, 0, 0, 0};
        range_slots(b0[t], b1[t], cbase[t], x, per, seq.data(), qsl.data(), bn, kOV, c);
        if (c.b >= 0 && t != owner) return fail("fused: a second owner of x", B, P, bn);
      }
    }
    PartCursor cur{B, 0, 0, 0};  // thread 0's default: no pieces
    if (x < total) {
      if (own.b < 0) return fail("fused: no owner of x", B, P, bn);
      cur = PartCursor{own.b, own.c, own.g + gbase[owner], own.g_next + gbase[owner]};
    } else if (own.b >= 0) {
      return fail("fused: an owner past the line's end", B, P, bn);
    }
    const int hi = std::min(x + per, total);
    // ---- the walk
    int c = cur.c;
    int id = r.part_begin[part];
    for (int b = cur.b; b < B; ++b) {
      const int k = req_tiles(qsl[b + 1] - qsl[b], seq[b], bn);
      if (k == 0) continue;
      PartPiece pc;
      const int slots_before = b == cur.b ? cur.g : cur.g_next;
      if (!part_piece(k, part, per, hi, kOV, slots_before, c, pc)) break;
      if (id >= r.part_begin[part + 1]) return fail("fused: more pieces than the reference's part", B, P, bn);
      if (r.preq[id] != b || r.pt0[id] != pc.t0 || r.pt1[id] != pc.t1 || r.pslot[id] != pc.slot)
        return fail("fused: piece differs from the reference", B, P, bn);
      ++id;
      ++*pieces_checked;
      if (pc.first) {  // the row-tile-0 CTA of this part writes the request's split counts
        npieces[b] = pc.npieces;
        slot0[b] = pc.slot0;
        ++writes[b];
      }
    }
    if (id != r.part_begin[part + 1]) return fail("fused: fewer pieces than the reference's part", B, P, bn);
  }
  for (int b = 0; b < B; ++b) {
    if (writes[b] != 1) return fail("fused: request's split counts not written exactly once", B, P, bn);
    if (npieces[b] != r.npc[b] || slot0[b] != r.slot0[b]) return fail("fused: req_npieces / req_slot0", B, P, bn);
  }
  return 0;
}

int main() {
  std::mt19937 rng(1234), sample(99);  // cases; the parts whose owner search runs in all threads
  int bad = 0, cases = 0;
  long long pieces = 0;
  double worst_imb = 0.0;
  auto run = [&](const std::vector<int>& seq, const std::vector<int>& ql, int P, int bn) {
    std::vector<int> qsl(seq.size() + 1, 0);
    for (size_t b = 0; b < seq.size(); ++b) qsl[b + 1] = qsl[b] + ql[b];
    for (int min_tiles : {1, kLineMinTiles}) {  // the decode kernel uses kLineMinTiles
      double imb = 0;
      const Plan r = reference(seq, qsl, P, bn, min_tiles);
      const int e = check_reference(r, seq, qsl, P, bn, min_tiles, &imb);
      bad += e;
      if (e == 0) bad += check_fused(r, seq, qsl, P, bn, min_tiles, sample, &pieces);
      ++cases;
      if (min_tiles == kLineMinTiles && seq.size() == 1 && P >= 8 && seq[0] > 64 * P * bn)
        worst_imb = std::max(worst_imb, imb);
    }
  };
  // edge cases: one request, empty and padding requests (q_len 0, L 0), L 0 / 1 / 16 / 17 / huge, B around the
  // 128-thread chunking (127, 128, 129, 1024, 8192), P from 1 to 800
  run({1}, {1}, 1, 16);
  run({0}, {0}, 5, 16);
  run({7}, {0}, 5, 16);
  run({0}, {1}, 5, 16);
  run({131072}, {1}, 396, 16);
  run({131072}, {1}, 1, 16);
  run({1 << 30}, {1}, 800, 16);
  run({16384}, std::vector<int>(1, 1), 264, 16);
  run(std::vector<int>(16, 16384), std::vector<int>(16, 1), 396, 16);
  run(std::vector<int>(64, 4096), std::vector<int>(64, 1), 396, 16);
  run(std::vector<int>(1024, 4096), std::vector<int>(1024, 1), 396, 16);
  run(std::vector<int>(1024, 17), std::vector<int>(1024, 2), 396, 16);
  run(std::vector<int>(8192, 100), std::vector<int>(8192, 1), 396, 16);
  run(std::vector<int>(8192, 100), std::vector<int>(8192, 1), 1, 64);
  run({5, 0, 1000, 0, 0, 17}, {1, 0, 2, 0, 0, 64}, 396, 16);
  run({5, 1000, 7, 9, 4113}, {0, 2, 0, 0, 1}, 3, 32);
  for (int B : {127, 128, 129, 255, 257}) {
    for (int L : {0, 1, 16, 17, 1000, 1 << 20}) {
      run(std::vector<int>(B, L), std::vector<int>(B, 1), 132, 16);
      run(std::vector<int>(B, L), std::vector<int>(B, 1), 800, 16);
    }
    std::vector<int> seq(B), ql(B);
    for (int b = 0; b < B; ++b) {  // every other request padding (q_len 0), the rest alternately L = 0 and long
      ql[b] = b % 2;
      seq[b] = b % 4 == 1 ? 0 : 5000 + b;
    }
    run(seq, ql, 396, 16);
    run(seq, ql, 1, 16);
  }
  // random
  for (int it = 0; it < 20000; ++it) {
    const int B = 1 + rng() % (it % 10 == 0 ? 3000 : 70);
    const int P = 1 + rng() % 800;
    const int bn = 16 << (rng() % 3);
    std::vector<int> seq(B), ql(B);
    const int lmax = (rng() % 4 == 0) ? 200 : (rng() % 3 == 0 ? 140000 : 20000);
    for (int b = 0; b < B; ++b) {
      ql[b] = rng() % 5 == 0 ? 0 : 1 + rng() % 64;
      seq[b] = rng() % 20 == 0 ? 0 : std::max(ql[b], static_cast<int>(rng() % lmax));
    }
    run(seq, ql, P, bn);
  }
  std::printf("%d cases, %d failed; %lld pieces matched; single long request: worst part / ideal = %.3f\n", cases, bad,
              pieces, worst_imb);
  return bad == 0 ? 0 : 1;
}
