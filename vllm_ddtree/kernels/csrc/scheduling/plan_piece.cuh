// The 64-row kernels' (variants/resident_v.cu, variants/portable.cu) reader of the device scheduler's plan
// (scheduling/sched_kernel.cu, laid out as a SchedView).
#pragma once

#include "params.h"

namespace ddtree {

// One piece of the plan as the 64-row kernels read it: its request's packed rows first, and the rest only when the
// CTA's row tile (rows row0 .. row0 + kBM - 1) reaches into them; false (nothing else read) when it does not.
struct PlanPiece {
  int q0, rows;       // the request's first query token and packed rows (q_len x H)
  int L, tree_start;  // its keys (tree tokens included) and the first tree key
  int t0, t1, slot;   // the piece's KV tiles and workspace slot (-1: the request's only piece)
  const int* bt;      // the request's block-table row
};
__device__ __forceinline__ bool read_plan_piece(const MlaParams& p, const SchedView& sv, int pc, int row0,
                                                PlanPiece& v) {
  const int b = sv.piece_req[pc];
  v.q0 = p.qsl[b];
  const int n = p.qsl[b + 1] - v.q0;
  v.rows = n * p.H;
  if (row0 >= v.rows) return false;
  v.L = p.seq_lens[b];
  v.tree_start = v.L - n;
  v.t0 = sv.piece_t0[pc];
  v.t1 = sv.piece_t1[pc];
  v.slot = sv.piece_slot[pc];
  v.bt = p.block_table + (int64_t)b * p.bt_stride;
  return true;
}

}  // namespace ddtree
