// Device-side split-KV planners for the MLA tree-verify kernels.
// They run inside the captured graph: read seq_lens / query_start_loc on the device and cut the concatenated
// KV-tile sequence of all requests into P parts of about equal cost, so grid and workspace stay fixed.
// - mla_sched_kernel: greedy, one thread (exact per-piece overhead accounting; B + P serial steps). Used by the
//   64-row kernels (P = SMs / row tiles).
// - mla_sched_line_kernel: the line planner of mla_sched_plan.cuh, parallel over requests and parts. Used by the
//   decode kernel, whose P is several CTAs per SM.
#include "mla_sched_plan.cuh"
#include "mla_tree_verify.cuh"

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

namespace {

constexpr int kLineThreads = 512;

// Exclusive block-wide prefix sum of v (every thread calls it); total = the sum over the block.
__device__ int block_excl_scan(int v, int* s_warp, int& total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  constexpr int kWarps = kLineThreads / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) s_warp[w] = incl;
  __syncthreads();
  if (w == 0) {
    int t = lane < kWarps ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += y;
    }
    if (lane < kWarps) s_warp[lane] = t;  // inclusive prefix over warps
  }
  __syncthreads();
  total = s_warp[kWarps - 1];
  const int excl = incl - v + (w > 0 ? s_warp[w - 1] : 0);
  __syncthreads();  // s_warp is reused by the next scan
  return excl;
}

// One block; thread t owns the contiguous requests [t*chunk, (t+1)*chunk) for the prefix sums, then parts
// t, t + 512, ... Per-request scratch lives in the sched buffer (global; __syncthreads orders it within the block).
__global__ void __launch_bounds__(kLineThreads) mla_sched_line_kernel(const int* __restrict__ seq_lens,
                                                                      const int* __restrict__ qsl, int B, int P,
                                                                      int block_n, int* __restrict__ sched) {
  __shared__ int s_warp[kLineThreads / 32];
  SchedView sv(sched, B, P);
  int* sK = sv.scratch;
  int* sC = sK + B;
  int* sS = sC + B;
  const int tid = threadIdx.x;
  const int chunk = (B + kLineThreads - 1) / kLineThreads;
  const int b0 = min(B, tid * chunk), b1 = min(B, b0 + chunk);
  int total = 0, np_total = 0, ns_total = 0;
  const int csum = plan::chunk_cost(b0, b1, seq_lens, qsl, block_n, kSchedOverhead, sK);
  const int cbase = block_excl_scan(csum, s_warp, total);
  const int per = plan::part_len(total, P, kSchedOverhead, plan::kLineMinTiles);
  int np = 0, ns = 0;
  plan::chunk_count(b0, b1, cbase, kSchedOverhead, per, sK, sC, np, ns);
  const int pbase = block_excl_scan(np, s_warp, np_total);
  const int sbase = block_excl_scan(ns, s_warp, ns_total);
  plan::chunk_write(b0, b1, pbase, sbase, kSchedOverhead, per, sK, sC, sS, sv.req_npieces, sv.req_slot0);
  __syncthreads();  // scratch and req_* of every chunk are visible to the whole block
  for (int part = tid; part < P; part += kLineThreads)
    plan::plan_part(part, B, total, per, kSchedOverhead, np_total, sK, sC, sS, sv.req_slot0, sv.part_begin,
                    sv.piece_req, sv.piece_t0, sv.piece_t1, sv.piece_slot);
  if (tid == 0) sv.part_begin[P] = np_total;
}

}  // namespace

void launch_mla_sched_line(const MlaParams& p, cudaStream_t stream) {
  mla_sched_line_kernel<<<1, kLineThreads, 0, stream>>>(p.seq_lens, p.qsl, p.B, p.num_parts, p.block_n, p.sched);
}

}  // namespace ddtree
