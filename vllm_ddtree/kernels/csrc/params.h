// MLA tree-verify attention: the parameters every kernel and the torch binding (api/bindings.cpp) share: the constants
// mirrored from vllm_ddtree/constants.py (with static_asserts on how they relate), the kernel ids, the split buffers'
// layouts and MlaParams. Kept free of torch headers so the .cu files compile with plain nvcc (CI build test).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace ddtree {

// ---- Mirrors of vllm_ddtree/constants.py, one a line as "constexpr <type> <name> = <value>;  // <CONSTANT>":
// tests/test_constants.py parses these lines and checks each value against constants.<CONSTANT>.
constexpr int kAncestorWordBits = 64;          // ANCESTOR_WORD_BITS
constexpr int kMaxTreeTokens = 64;             // MAX_TREE_WIDTH
constexpr int kMaxTreeBudget = 63;             // MAX_TREE_BUDGET
constexpr int kDV = 512;                       // MLA_KV_LORA_RANK
constexpr int kDRope = 64;                     // MLA_ROPE_DIM
constexpr int kDQK = 576;                      // MLA_HEAD_DIM
constexpr double kLog2e = 1.4426950408889634;  // LOG2E
constexpr int kVariantPortable = 0;            // MLA_KERNEL_PORTABLE
constexpr int kVariantResidentV = 1;           // MLA_KERNEL_RESIDENT_V
constexpr int kVariantDecode = 2;              // MLA_KERNEL_DECODE
constexpr int kResidentVSmem = 231424;         // MLA_RESIDENT_V_SMEM
constexpr int kDecodeDeepSmemBf16 = 90112;     // MLA_DECODE_DEEP_SMEM_BF16
constexpr int kDecodeDeepSmemFp8 = 108544;     // MLA_DECODE_DEEP_SMEM_FP8
static_assert(sizeof(uint64_t) * 8 == kAncestorWordBits, "tree_bits holds one uint64 ancestor word per query");
static_assert(kMaxTreeTokens == kAncestorWordBits, "one word holds a whole tree, root included");
static_assert(kMaxTreeBudget == kMaxTreeTokens - 1, "the budget counts the tree's nodes without the root");
static_assert(kDQK == kDV + kDRope, "a latent cache row is the 512 latent dims, then the 64 rope dims");

constexpr int kBM = 64;          // packed (node, head) rows per CTA
constexpr int kSchedOverhead = 5;  // per-piece cost in KV tiles, used by the device scheduler
// Lazy rescaling (both kernels' online softmax): a row's reference max moves only when a tile's max exceeds it by
// more than this (log2 units), so P <= 2^8 (bf16 keeps its relative precision) and O is rescaled on few tiles.
constexpr float kRescaleSlack = 8.f;

// Split plan of the 64-row kernels' planner (scheduling/sched_kernel.cu), one int32 buffer. MP = B + P pieces at most (each
// piece ends a request or a part).
struct SchedView {
  int* part_begin;   // [P+1] piece range of each part
  int* piece_req;    // [MP]
  int* piece_t0;     // [MP] first KV tile
  int* piece_t1;     // [MP] one past the last KV tile
  int* piece_slot;   // [MP] workspace slot for split requests, -1 when the request has a single piece
  int* req_npieces;  // [B]
  int* req_slot0;    // [B] workspace slot of the request's first piece
  __host__ __device__ SchedView(int* base, int B, int P) {
    const int mp = B + P;
    part_begin = base;
    piece_req = part_begin + P + 1;
    piece_t0 = piece_req + mp;
    piece_t1 = piece_t0 + mp;
    piece_slot = piece_t1 + mp;
    req_npieces = piece_slot + mp;
    req_slot0 = req_npieces + B;
  }
  static __host__ __device__ int64_t size(int B, int P) { return (P + 1) + 4 * (int64_t)(B + P) + 2 * (int64_t)B; }
};

// The decode variant's split buffer: only what its combine reads. Its kernel derives the pieces in every CTA
// (scheduling/sched_plan.cuh) and writes these two arrays; nothing lists the pieces.
struct DecodeSplitView {
  int* req_npieces;  // [B] pieces of the request (0: no tiles)
  int* req_slot0;    // [B] workspace slot of its first piece, -1 unless split
  __host__ __device__ DecodeSplitView(int* base, int B) : req_npieces(base), req_slot0(base + B) {}
  static __host__ __device__ int64_t size(int B) { return 2 * (int64_t)B; }
};

struct MlaParams {
  // queries, element strides, 16-byte aligned rows
  const void* q_nope;
  const void* q_pe;
  int64_t q_nope_s0, q_nope_s1, q_pe_s0, q_pe_s1;
  bool q_fp16;
  // paged cache, byte strides
  const uint8_t* kv;
  int64_t kv_page_stride, kv_row_stride;
  int page_log2;
  bool kv_fp8;
  const int* block_table;
  int64_t bt_stride;
  const int* seq_lens;
  const int* qsl;
  const int64_t* tree_bits;
  float scale_log2;  // softmax_scale * kv_scale * log2(e)
  float kv_scale;
  // outputs
  void* out;
  int64_t out_s0, out_s1;
  bool out_fp16;
  float* lse;
  int64_t lse_s0, lse_s1;
  // fixed launch geometry (host-known, never derived from seq_lens values)
  int B, H, max_q, num_parts, num_row_tiles;
  int* sched;      // SchedView, or DecodeSplitView for the decode variant
  float* ws_o;    // [num_slots, max_q*H, 512] normalized fp32 partials (64-row variants)
  uint16_t* ws_o_bf16;  // the decode variant's partials, same shape, as bf16 bits (half the bytes to write and merge)
  float* ws_lse;  // [num_slots, max_q*H] base-2 lse of the partials
  int variant;    // kVariantPortable, kVariantResidentV, or kVariantDecode
  int block_n;    // KV tile width of that variant (the scheduler plans in these tiles)
};

// The kernels (ids above, the `kernel` parameter of the op, picked by vllm_ddtree/kernels/mla_dispatch.py):
// portable: <= 99 KB smem, Q in registers (sm_80 / sm_86 / sm_89 / sm_120; variants/portable.cu); resident-V:
// ~226 KB smem, V resident, whole next tile in flight (sm_90; variants/resident_v.cu); decode: 16-row CTAs, several
// per SM (every GPU, few rows a request; variants/decode.cu).
constexpr int kDecodeBM = 16;         // packed rows per decode CTA (row tiles = ceil(max_q * H / 16))

// KV tile width of a kernel: the 64-row kernels' scheduler plans in these tiles (each kernel static_asserts its own).
constexpr int mla_variant_block_n(int variant) {
  return variant == kVariantDecode ? 16 : variant == kVariantResidentV ? 64 : 32;
}

// Number of workspace slots needed for P parts and B requests (split pieces <= 2(P-1)).
inline int mla_num_slots(int B, int P) {
  const int a = B + P, b = 2 * P;
  return a < b ? a : b;
}

}  // namespace ddtree
