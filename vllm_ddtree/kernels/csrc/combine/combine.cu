// The split-KV combines: a request whose keys were cut into several pieces has one normalized partial and one base-2
// lse per piece and row in the workspace; these kernels merge them by log-sum-exp into out / lse, in a fixed order
// (deterministic). One per kind of partial: fp32 partials of the 64-row kernels (variants/resident_v.cu,
// variants/portable.cu; the pieces listed in a SchedView) and bf16 partials of the decode kernel (variants/decode.cu;
// the split counts in a DecodeSplitView). Each runs right after its main kernel on the same stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "device_utils.cuh"
#include "entry_points.h"
#include "launch.cuh"
#include "params.h"

namespace ddtree {
namespace {

using namespace dev;  // device_utils.cuh

// One warp per (request, row): merges the request's split partials by log-sum-exp. Fixed order: deterministic.
__global__ void __launch_bounds__(256) mla_combine_kernel(const MlaParams p) {
  const int b = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.y * 8 + warp;
  const int q0 = p.qsl[b];
  const int n = p.qsl[b + 1] - q0;
  if (row >= n * p.H) return;
  SchedView sv(p.sched, p.B, p.num_parts);
  const int np = sv.req_npieces[b];
  if (np <= 1) return;
  const int slot0 = sv.req_slot0[b];
  const int rstride = p.max_q * p.H;
  float mx = -INFINITY;
  for (int i = lane; i < np; i += 32) mx = fmaxf(mx, p.ws_lse[(int64_t)(slot0 + i) * rstride + row]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float mu = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
  for (int i = lane; i < np; i += 32) sum += exp2f(p.ws_lse[(int64_t)(slot0 + i) * rstride + row] - mu);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  float4 acc[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = 0; i < np; ++i) {
    const int64_t base = (int64_t)(slot0 + i) * rstride + row;
    const float w = exp2f(p.ws_lse[base] - mu) * inv;
    const float4* src = reinterpret_cast<const float4*>(p.ws_o + base * kDV);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 v = src[lane + 32 * k];
      acc[k].x += w * v.x;
      acc[k].y += w * v.y;
      acc[k].z += w * v.z;
      acc[k].w += w * v.w;
    }
  }
  const int node = row / p.H, head = row % p.H;
  const int64_t tok = q0 + node;
  char* orow = reinterpret_cast<char*>(p.out) + (tok * p.out_s0 + head * p.out_s1) * 2;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int d = (lane + 32 * k) * 4;
    const uint2 w = make_uint2(pack_out(acc[k].x, acc[k].y, p.out_fp16), pack_out(acc[k].z, acc[k].w, p.out_fp16));
    *reinterpret_cast<uint2*>(orow + d * 2) = w;
  }
  if (lane == 0) p.lse[tok * p.lse_s0 + head * p.lse_s1] = sum > 0.f ? (mu + log2f(sum)) * kLn2 : -INFINITY;
}

// Merges the split partials of one (request, row, 128-dim slice) in a team of W = 2^team_log2 warps (1..32), sized
// by the host from the pieces an average request has: 32 warps for the hundreds of pieces of B = 1, single warps for
// the few pieces of large batches (few blocks, about one wave). A block holds max(8, W) warps. The time is set by
// chains of memory latencies, not by bytes (measured: docs/results.md, section 6.5). So each warp loads up to kCombineChunk of its pieces (k, k + W, ...) into
// registers at once, lse and partial together, then folds them into its running (max m, sum s, acc): one memory
// latency for up to W * kCombineChunk pieces. The team's first warp merges the W triples in warp order (fixed order
// throughout: deterministic). Teams of rows without a split exit.
constexpr int kCombineMaxTeamLog2 = 5;
// pieces a warp loads at once: B = 1 on up to 160 SMs x 2 CTAs in one round (12 spilled on sm_80 / sm_90)
constexpr int kCombineChunk = 10;

struct CombinePart {  // one warp's running merge; lse terms in base 2
  float m, s;
  float4 acc;
};

__global__ void __launch_bounds__(1024) mla_combine_wide_kernel(const MlaParams p, int team_log2) {
  extern __shared__ CombinePart red[];  // [warps of the block][32]
  grid_dep_wait();  // the main kernel's partials and split counts complete and visible (PDL on sm_90+)
  grid_dep_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int W = 1 << team_log2, sub = warp & (W - 1);
  const int rstride = p.max_q * p.H;
  const int team = blockIdx.x * ((blockDim.x >> 5) >> team_log2) + (warp >> team_log2);
  const int slice = team & 3, row = (team >> 2) % rstride, b = (team >> 2) / rstride;
  const DecodeSplitView sv(p.sched, p.B);
  int q0 = 0, np = 0;
  if (b < p.B) {
    q0 = p.qsl[b];
    if (row < (p.qsl[b + 1] - q0) * p.H) np = sv.req_npieces[b];
  }
  const bool active = np > 1;  // warp-uniform; np <= 1: written directly by the main kernel (or no work)
  const int slot0 = active ? sv.req_slot0[b] : 0;
  CombinePart c{-INFINITY, 0.f, make_float4(0.f, 0.f, 0.f, 0.f)};
  for (int i0 = sub; active && i0 < np; i0 += W * kCombineChunk) {
    const int cnt = min(kCombineChunk, (np - i0 + W - 1) / W);  // this warp's pieces in the round (warp-uniform)
    float l[kCombineChunk];
    uint2 v[kCombineChunk];
#pragma unroll
    for (int k = 0; k < kCombineChunk; ++k) {
      if (k < cnt) {
        const int64_t base = (int64_t)(slot0 + i0 + k * W) * rstride + row;
        l[k] = p.ws_lse[base];
        v[k] = reinterpret_cast<const uint2*>(p.ws_o_bf16 + base * kDV + slice * 128)[lane];  // 4 bf16
      }
    }
    float mx = c.m;
#pragma unroll
    for (int k = 0; k < kCombineChunk; ++k)
      if (k < cnt) mx = fmaxf(mx, l[k]);
    const float ref = mx == -INFINITY ? 0.f : mx;  // all-masked so far: every weight is exp2(-inf) = 0
    const float keep = fast_exp2(c.m - ref);
    c.s *= keep;
    c.acc = make_float4(c.acc.x * keep, c.acc.y * keep, c.acc.z * keep, c.acc.w * keep);
#pragma unroll
    for (int k = 0; k < kCombineChunk; ++k) {
      if (k >= cnt) break;  // only the pieces loaded: the math after the loads is the call's serial tail
      const float w = fast_exp2(l[k] - ref);
      const float4 x = unpack_bf16x4(v[k]);
      c.s += w;
      c.acc.x += w * x.x;
      c.acc.y += w * x.y;
      c.acc.z += w * x.z;
      c.acc.w += w * x.w;
    }
    c.m = mx;
  }
  red[warp * 32 + lane] = c;
  __syncthreads();
  if (!active || sub != 0) return;
  float mu = -INFINITY;
  for (int w = 0; w < W; ++w) mu = fmaxf(mu, red[(warp + w) * 32 + lane].m);
  if (mu == -INFINITY) mu = 0.f;
  float sum = 0.f;
  float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int w = 0; w < W; ++w) {
    const CombinePart& o = red[(warp + w) * 32 + lane];
    const float k = exp2f(o.m - mu);
    sum += k * o.s;
    t.x += k * o.acc.x;
    t.y += k * o.acc.y;
    t.z += k * o.acc.z;
    t.w += k * o.acc.w;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const int node = row / p.H, head = row % p.H;
  const int64_t tok = q0 + node;
  char* orow = reinterpret_cast<char*>(p.out) + (tok * p.out_s0 + head * p.out_s1) * 2;
  const int d = slice * 128 + lane * 4;
  // two 4-byte stores: the binding guarantees 4-byte aligned output rows (even strides), not 8
  *reinterpret_cast<uint32_t*>(orow + d * 2) = pack_out(t.x * inv, t.y * inv, p.out_fp16);
  *reinterpret_cast<uint32_t*>(orow + d * 2 + 4) = pack_out(t.z * inv, t.w * inv, p.out_fp16);
  if (slice == 0 && lane == 0)
    p.lse[tok * p.lse_s0 + head * p.lse_s1] = sum > 0.f ? (mu + log2f(sum)) * kLn2 : -INFINITY;
}

}  // namespace

void launch_mla_combine(const MlaParams& p, cudaStream_t stream) {
  dim3 cgrid(p.B, (p.max_q * p.H + 7) / 8);  // launch geometry, fixed under a CUDA graph
  mla_combine_kernel<<<cgrid, 256, 0, stream>>>(p);
}

void launch_mla_combine_wide(const MlaParams& p, bool pdl, cudaStream_t stream) {
  // combine teams: about 8 pieces a warp for the average request (at most (P + B) / B pieces), 1..32 warps
  const int avg_pieces = (p.num_parts + 2 * p.B - 1) / p.B;
  int team_log2 = 0;
  while (team_log2 < kCombineMaxTeamLog2 && (8 << team_log2) < avg_pieces) ++team_log2;
  const int warps = (1 << team_log2) > 8 ? 1 << team_log2 : 8;  // a block: 8 warps, or one team of 16 / 32
  const int64_t teams = (int64_t)p.B * p.max_q * p.H * (kDV / 128);
  const int per_block = warps >> team_log2;
  const int blocks = static_cast<int>((teams + per_block - 1) / per_block);
  launch_kernel(mla_combine_wide_kernel, dim3(blocks), 32 * warps, static_cast<int>(warps * 32 * sizeof(CombinePart)),
                stream, pdl, p, team_log2);
}

}  // namespace ddtree
