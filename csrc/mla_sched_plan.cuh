// Line planner for split-KV: the arithmetic of the parallel device scheduler (mla_sched_line_kernel in
// mla_tree_verify_sched.cu), kept free of CUDA headers so a host harness (tests/csrc/sched_plan_check.cpp) runs the
// very same functions on the CPU.
//
// Why a second planner: the greedy one walks all pieces in one thread, B + P iterations of ~30 dependent
// instructions (~10 us at P = 400 parts). The decode kernel wants P = (CTAs per SM) x SMs parts, so it plans in
// parallel: every request is laid on a cost line, [C_b, C_b + OV + k_b) (OV overhead units in front of its k_b
// tiles, C_b = sum of the costs before it), the line is cut into P equal parts of `per` units, and a piece is the
// intersection of a request's tiles with a part. Everything follows from prefix sums and one binary search per part.
//
// Invariants (checked by the host harness):
// - per >= OV + 1 (part_len), so every part whose range starts before the line's end holds at least one tile;
//   later parts are empty (part_begin = total pieces).
// - pieces are numbered by request, then by part, which is also their order by part: the pieces of part p are
//   [part_begin[p], part_begin[p+1]).
// - request b has n_b = pl_b - pf_b + 1 pieces (pf_b / pl_b: parts of its first / last tile), consecutive ids from
//   S_b, consecutive tile ranges covering [0, k_b); if n_b > 1 its workspace slots are slot0_b + i, else -1.
// - total pieces <= B + P - 1 and total slots <= 2 (P - 1): within SchedView and mla_num_slots.
#pragma once

#include "host_device.cuh"

namespace ddtree {
namespace plan {

DDTREE_HD int req_tiles(int n, int L, int bn) { return (n > 0 && L > 0) ? (L + bn - 1) / bn : 0; }
DDTREE_HD int req_cost(int k, int ov) { return k > 0 ? k + ov : 0; }
// Line units per part: an equal share, but at least ov + min_tiles (min_tiles >= 1), so that a part's pieces are not
// all overhead: short contexts then use fewer parts instead of one-tile pieces whose partials cost more than them.
DDTREE_HD int part_len(int total, int P, int ov, int min_tiles) {
  const int per = (total + P - 1) / P;
  return per < ov + min_tiles ? ov + min_tiles : per;
}

// Phase 1 (requests [b0, b1) of one thread): tiles per request into sK; returns the chunk's line length.
DDTREE_HD int chunk_cost(int b0, int b1, const int* seq_lens, const int* qsl, int bn, int ov, int* sK) {
  int c = 0;
  for (int b = b0; b < b1; ++b) {
    const int k = req_tiles(qsl[b + 1] - qsl[b], seq_lens[b], bn);
    sK[b] = k;
    c += req_cost(k, ov);
  }
  return c;
}

// Phase 2: line starts into sC (cbase: the chunk's first line position); piece and slot counts of the chunk.
DDTREE_HD void chunk_count(int b0, int b1, int cbase, int ov, int per, const int* sK, int* sC, int& npieces,
                           int& nslots) {
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
DDTREE_HD void chunk_write(int b0, int b1, int pbase, int sbase, int ov, int per, const int* sK, const int* sC,
                           int* sS, int* req_npieces, int* req_slot0) {
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
DDTREE_HD void plan_part(int p, int B, int total, int per, int ov, int np_total, const int* sK, const int* sC,
                         const int* sS, const int* req_slot0, int* part_begin, int* piece_req, int* piece_t0,
                         int* piece_t1, int* piece_slot) {
  const int x = p * per;
  if (x >= total) {
    part_begin[p] = np_total;
    return;
  }
  const int hi = x + per < total ? x + per : total;
  // the request whose line range holds x: the largest b with C_b <= x (it has tiles, see the header)
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

}  // namespace plan
}  // namespace ddtree
