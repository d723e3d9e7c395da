// Line plan for split-KV, derived per part: the arithmetic the decode kernel (variants/decode.cu) runs at the
// start of every CTA to find its own part's pieces, kept free of CUDA headers so a host harness
// (tests/csrc/sched_plan_check.cpp) runs the very same functions on the CPU.
//
// The plan: every request is laid on a cost line, [C_b, C_b + OV + k_b) (OV overhead units in front of its k_b
// tiles, C_b = sum of the costs before it; cost 0 without tiles), the line is cut into P parts of `per` units
// (part p covers [p * per, min((p + 1) * per, total))), and a piece is the intersection of a request's tiles with a
// part. Request b's pieces lie in the parts pf_b .. pl_b of its first and last tile, n_b = pl_b - pf_b + 1 of them;
// if n_b > 1 they use the workspace slots G_b .. G_b + n_b - 1, G_b = the slots of the split requests before b.
//
// Why per part, in the main kernel: a separate planner launch (one block writing every piece to global memory)
// costs a launch and its gap, a sizeable share of the main kernel at memory-bound shapes (measured:
// docs/results.md, section 6.5). A part
// needs from the requests before it only two prefix sums at its first request: C and G. So each CTA computes the
// line total and those prefix sums with two block scans over the requests (range_cost, range_slots: a thread sums a
// contiguous range of them), then walks its requests from that cursor, one piece each (part_piece), carrying C.
//
// Invariants (checked by the host harness against the global planner this replaced, case by case):
// - per >= OV + min_tiles (part_len), so every part whose range starts before the line's end holds at least one tile;
//   a part starting at or past the end (x >= total) has no pieces.
// - the walk of part p starts at the one request with tiles whose line range holds x = p * per (range_slots) and
//   stops at the first request with tiles whose tile 0 lies at or past the part's end: its pieces are exactly the
//   requests' tiles within the part, in request order; requests without tiles are skipped.
// - request b's piece in part p has index i = p - pf_b (pf_b = part of its tile 0), tiles [t0, t1) consecutive over
//   its parts and covering [0, k_b), slot G_b + i if n_b > 1, else -1. Only a part's first request can have tiles
//   before it, so G is the same for all its other requests (PartCursor::g_next).
// - exactly one part has i = 0 for a request with tiles (pf_b < P since C_b + OV < total <= P * per): that part's
//   row-tile-0 CTA writes req_npieces / req_slot0 for the combine.
// - total slots <= 2 (P - 1) (a slot pair per part boundary at most): within mla_num_slots.
#pragma once

#include "host_device.cuh"

namespace ddtree {
namespace plan {

constexpr int kLineMinTiles = 8;  // the decode kernel's parts: >= 8 tiles of line units (128 keys)

DDTREE_HD int req_tiles(int n, int L, int bn) { return (n > 0 && L > 0) ? (L + bn - 1) / bn : 0; }
DDTREE_HD int req_cost(int k, int ov) { return k > 0 ? k + ov : 0; }
// Line units per part: an equal share, but at least ov + min_tiles (min_tiles >= 1), so that a part's pieces are not
// all overhead: short contexts then use fewer parts instead of one-tile pieces whose partials cost more than them.
DDTREE_HD int part_len(int total, int P, int ov, int min_tiles) {
  const int per = (total + P - 1) / P;
  return per < ov + min_tiles ? ov + min_tiles : per;
}

// Line cost of the requests [b0, b1). Where npieces / slot0 are given (one CTA of the launch), requests without tiles
// get 0 / -1 there: no part writes them, and the combine reads req_npieces for the rows of a request with q_len > 0
// even when its L = 0.
DDTREE_HD int range_cost(int b0, int b1, const int* seq_lens, const int* qsl, int bn, int ov, int* npieces,
                         int* slot0) {
  int c = 0;
  int q = b0 < b1 ? qsl[b0] : 0;
  for (int b = b0; b < b1; ++b) {
    const int q1 = qsl[b + 1];
    const int k = req_tiles(q1 - q, seq_lens[b], bn);
    q = q1;
    c += req_cost(k, ov);
    if (k == 0 && npieces != nullptr) {
      npieces[b] = 0;
      slot0[b] = -1;
    }
  }
  return c;
}

// Where a part's walk starts: its first request b (the one whose line range holds x = p * per), b's line start c,
// the slots g of the split requests before b, and g_next = g + b's own slots (if split). Every later request with
// pieces in the part has g_next slots before it: those requests start inside the part, so all but the last end there
// too (single pieces, no slots).
struct PartCursor {
  int b, c, g, g_next;
};

// Slots of the split requests [b0, b1) (line start cbase, parts of `per` >= ov + 1 units, as part_len makes them).
// If one of them holds line position x in its line range (at most one request of the whole line does), cur = that
// request, its line start and its slots counted from b0 (the caller adds the slots before b0); otherwise cur is left
// alone. A request's pieces are the parts pf .. pl of its first and last tile. This runs over every request in every
// CTA, and a division by a runtime value is a long sequence, so: one division per request instead of two (the next
// tile 0 lies 1 + ov <= per units after this request's last tile e, so its part is pl or pl + 1, told by e's
// remainder), and unsigned (line positions are >= 0: no sign handling). sm_90: 273 -> 220 instructions per 4
// requests of the unrolled loop.
DDTREE_HD int range_slots(int b0, int b1, int cbase, int x, int per, const int* seq_lens, const int* qsl, int bn,
                          int ov, PartCursor& cur) {
  const unsigned uper = static_cast<unsigned>(per);
  int c = cbase, g = 0;
  int pf = static_cast<int>(static_cast<unsigned>(c + ov) / uper);  // part of the next tile 0
  int q = b0 < b1 ? qsl[b0] : 0;
  for (int b = b0; b < b1; ++b) {
    const int q1 = qsl[b + 1];
    const int k = req_tiles(q1 - q, seq_lens[b], bn);
    q = q1;
    if (k == 0) continue;
    const int e = c + ov + k - 1;  // line position of the last tile
    const int pl = static_cast<int>(static_cast<unsigned>(e) / uper);
    const int n = pl - pf + 1;
    const int ns = n > 1 ? n : 0;
    if (c <= x && x < c + ov + k) cur = PartCursor{b, c, g, g + ns};
    g += ns;
    c += ov + k;
    pf = pl + (e - pl * per + 1 + ov >= per ? 1 : 0);
  }
  return g;
}

// The piece of part p (line range [p * per, hi)) in a request of k > 0 tiles at line start c, with g slots before
// it. False when its tile 0 lies at or past hi: the part has no further pieces. Else fills the piece and moves c past
// the request.
struct PartPiece {
  int t0, t1;   // tile range
  int slot;     // workspace slot, -1 if the request has a single piece
  int npieces;  // the request's pieces (n_b) and first slot (-1 if n_b = 1), written where first
  int slot0;
  bool first;  // the request's first piece (its tile 0 is in this part)
};
DDTREE_HD bool part_piece(int k, int p, int per, int hi, int ov, int g, int& c, PartPiece& pc) {
  const int s0 = c + ov;  // line position of tile 0
  if (s0 >= hi) return false;
  const int pf = s0 / per;
  const int n = (s0 + k - 1) / per - pf + 1;  // parts pf .. of its first and last tile
  const int x = p * per;
  pc.t0 = x > s0 ? x - s0 : 0;
  pc.t1 = hi - s0 < k ? hi - s0 : k;
  pc.npieces = n;
  pc.slot0 = n > 1 ? g : -1;
  pc.slot = n > 1 ? g + (p - pf) : -1;
  pc.first = pf == p;
  c = s0 + k;
  return true;
}

}  // namespace plan
}  // namespace ddtree
