// Device-side split-KV planner of the 64-row MLA tree-verify kernels (P = SMs / row tiles parts).
// It runs inside the captured graph: reads seq_lens / query_start_loc on the device and cuts the concatenated KV-tile
// sequence of all requests into P parts of about equal cost, so grid and workspace stay fixed. Greedy, one thread
// (exact per-piece overhead accounting; B + P serial steps). The decode kernel plans in each of its CTAs instead
// (scheduling/sched_plan.cuh).
#include "entry_points.h"
#include "params.h"

namespace ddtree {

__global__ void mla_sched_kernel(const int* __restrict__ seq_lens, const int* __restrict__ qsl, int B, int P,
                                 int block_n, int* __restrict__ sched) {
  extern __shared__ int s_tiles[];  // [B] KV tiles per request, 0 = no work
  __shared__ int s_total[32];
  const int tid = threadIdx.x;
  int local = 0;
  for (int b = tid; b < B; b += blockDim.x) {
    const int n = qsl[b + 1] - qsl[b];
    const int L = seq_lens[b];
    // q_len 0 (graph padding) or empty context: no tiles, block_table never read.
    const int k = (n > 0 && L > 0) ? (L + block_n - 1) / block_n : 0;
    s_tiles[b] = k;
    local += k > 0 ? k + kSchedOverhead : 0;  // one overhead per request ...
  }
  for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(0xffffffffu, local, o);
  if ((tid & 31) == 0) s_total[tid >> 5] = local;
  __syncthreads();
  if (tid != 0) return;
  int total = 0;
  for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) total += s_total[w];

  SchedView sv(sched, B, P);
  // ... plus one per extra piece a split creates (at most P - 1): overestimating keeps the last part from
  // collecting the remainder.
  total += (P - 1) * kSchedOverhead;
  int per = (total + P - 1) / P;
  if (per < kSchedOverhead + 1) per = kSchedOverhead + 1;
  int part = 0, rem = per, npc = 0, nslot = 0;
  sv.part_begin[0] = 0;
  for (int b = 0; b < B; ++b) {
    const int k = s_tiles[b];
    const int first = npc;
    int t = 0;
    while (t < k) {
      if (part < P - 1 && rem <= kSchedOverhead) {  // no room for overhead + one tile: close this part
        ++part;
        sv.part_begin[part] = npc;
        rem = per;
      }
      int take = k - t;
      if (part < P - 1 && take > rem - kSchedOverhead) take = rem - kSchedOverhead;
      sv.piece_req[npc] = b;
      sv.piece_t0[npc] = t;
      sv.piece_t1[npc] = t + take;
      ++npc;
      rem -= kSchedOverhead + take;
      t += take;
    }
    const int cnt = npc - first;
    sv.req_npieces[b] = cnt;
    sv.req_slot0[b] = cnt > 1 ? nslot : -1;
    for (int i = first; i < npc; ++i) sv.piece_slot[i] = cnt > 1 ? nslot++ : -1;
  }
  for (int q = part + 1; q <= P; ++q) sv.part_begin[q] = npc;
}

void launch_mla_sched(const MlaParams& p, cudaStream_t stream) {
  mla_sched_kernel<<<1, 256, p.B * sizeof(int), stream>>>(p.seq_lens, p.qsl, p.B, p.num_parts, p.block_n, p.sched);
}

}  // namespace ddtree
