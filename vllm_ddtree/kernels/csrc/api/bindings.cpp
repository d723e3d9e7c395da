// Torch binding: registers ddtree::mla_tree_verify (CUDA + Meta) so it is callable from compiled models and
// inside CUDA graphs. Everything decided here comes from shapes, strides and host scalars; nothing reads device data.
// Which kernel runs (and how the decode kernel is configured) is a parameter: the Python dispatch table
// (vllm_ddtree/kernels/mla_dispatch.py) decides it; this file only checks it and sizes the launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "device_cache.h"
#include "entry_points.h"
#include "params.h"

namespace {

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The launch sequence on `stream`: the decode kernel plans in its own CTAs, then its wide combine; the 64-row
// kernels run after the device scheduler and before their combine. No host synchronization, no host reads of device
// data.
void launch(const ddtree::MlaParams& p, bool decode_deep, bool pdl, cudaStream_t stream) {
  if (p.variant == ddtree::kVariantDecode) {
    ddtree::launch_mla_decode(p, decode_deep, pdl, stream);
    ddtree::launch_mla_combine_wide(p, pdl, stream);
    return;
  }
  ddtree::launch_mla_sched(p, stream);
  if (p.variant == ddtree::kVariantResidentV) {
    ddtree::launch_mla_resident_v(p, stream);
  } else {
    ddtree::launch_mla_portable(p, stream);
  }
  ddtree::launch_mla_combine(p, stream);
}

void mla_tree_verify_cuda(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_cache,
                          const at::Tensor& block_table, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const at::Tensor& tree_bits, double softmax_scale,
                          double kv_scale, at::Tensor& out, at::Tensor& lse, int64_t max_query_len, int64_t kernel,
                          bool decode_deep, int64_t decode_ctas_per_sm, bool pdl) {
  TORCH_CHECK(q_nope.is_cuda() && q_pe.is_cuda() && kv_cache.is_cuda(), "mla_tree_verify: CUDA tensors expected");
  TORCH_CHECK(q_nope.dim() == 3 && q_nope.size(2) == ddtree::kDV, "q_nope must be [T, H, 512]");
  TORCH_CHECK(q_pe.dim() == 3 && q_pe.size(2) == ddtree::kDRope, "q_pe must be [T, H, 64]");
  const int64_t T = q_nope.size(0), H = q_nope.size(1);
  TORCH_CHECK(q_pe.size(0) == T && q_pe.size(1) == H, "q_pe shape mismatch");
  TORCH_CHECK(H % 8 == 0 && H >= 8 && H <= 128, "H must be a multiple of 8 in [8, 128]");
  const auto qdt = q_nope.scalar_type();
  TORCH_CHECK(qdt == at::kBFloat16 || qdt == at::kHalf, "q must be bf16 or fp16");
  TORCH_CHECK(q_pe.scalar_type() == qdt, "q_nope and q_pe dtypes differ");
  TORCH_CHECK(q_nope.stride(2) == 1 && q_pe.stride(2) == 1, "q last dim must be contiguous");
  TORCH_CHECK(aligned16(q_nope) && aligned16(q_pe) && q_nope.stride(0) % 8 == 0 && q_nope.stride(1) % 8 == 0 &&
                  q_pe.stride(0) % 8 == 0 && q_pe.stride(1) % 8 == 0,
              "q rows must be 16-byte aligned");

  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(2) == ddtree::kDQK, "kv_cache must be [blocks, block_size, 576]");
  const auto kdt = kv_cache.scalar_type();
  const bool fp8 = kdt == at::kByte || kdt == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || kdt == at::kBFloat16, "kv_cache must be bf16, or fp8 e4m3 (uint8 / float8_e4m3fn)");
  const int64_t page = kv_cache.size(1);
  TORCH_CHECK(page >= 1 && page <= 4096 && (page & (page - 1)) == 0, "block_size must be a power of two");
  TORCH_CHECK(kv_cache.stride(2) == 1, "kv_cache last dim must be contiguous");
  const int64_t esz = kv_cache.element_size();
  TORCH_CHECK(aligned16(kv_cache) && (kv_cache.stride(0) * esz) % 16 == 0 && (kv_cache.stride(1) * esz) % 16 == 0,
              "kv_cache rows must be 16-byte aligned");
  TORCH_CHECK(kv_cache.stride(1) * esz < (int64_t(1) << 31), "kv_cache row stride must be below 2 GiB");

  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be int32 [B, max_blocks] with contiguous rows");
  const int64_t B = block_table.size(0);
  TORCH_CHECK(B >= 1 && B <= 8192, "batch size must be in [1, 8192]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == B,
              "seq_lens must be int32 [B]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == B + 1,
              "query_start_loc must be int32 [B+1]");
  TORCH_CHECK(tree_bits.scalar_type() == at::kLong && tree_bits.is_contiguous() && tree_bits.numel() >= T,
              "tree_bits must be int64 [T]");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == T && out.size(1) == H && out.size(2) == ddtree::kDV &&
                  out.stride(2) == 1,
              "out must be [T, H, 512] with a contiguous last dim");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf, "out must be bf16 or fp16");
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0,
              "out rows must be 8-byte aligned");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == T && lse.size(1) == H,
              "lse must be float32 [T, H]");

  const int64_t max_q = max_query_len;
  TORCH_CHECK(softmax_scale > 0 && kv_scale > 0 && std::isfinite(softmax_scale * kv_scale),
              "softmax_scale and kv_scale must be positive and finite");
  TORCH_CHECK(max_q >= 1 && max_q <= ddtree::kMaxTreeTokens, "max_query_len must be in [1, 64]");
  TORCH_CHECK(kernel == ddtree::kVariantPortable || kernel == ddtree::kVariantResidentV ||
                  kernel == ddtree::kVariantDecode,
              "kernel must be 0 (portable), 1 (resident-V) or 2 (decode), got ", kernel);
  TORCH_CHECK(decode_ctas_per_sm >= 0, "decode_ctas_per_sm must be >= 0 (0: the occupancy)");
  if (T == 0) return;

  const c10::cuda::CUDAGuard guard(q_nope.device());
  const int device = q_nope.get_device();
  const ddtree::DeviceInfo& info = ddtree::device_info(device);
  TORCH_CHECK(info.sms > 0, "mla_tree_verify: could not query the attributes of CUDA device ", device);
  const int sms = info.sms;
  TORCH_CHECK(kernel != ddtree::kVariantResidentV || info.smem_per_block_optin >= ddtree::kResidentVSmem,
              "the resident-V kernel needs ", ddtree::kResidentVSmem, " bytes of shared memory a block; this GPU "
              "has ", info.smem_per_block_optin);
  TORCH_CHECK(kernel != ddtree::kVariantDecode || !decode_deep ||
                  info.smem_per_block_optin >= (fp8 ? ddtree::kDecodeDeepSmemFp8 : ddtree::kDecodeDeepSmemBf16),
              "the decode kernel's deep configuration does not fit this GPU's shared memory a block");
  const int rows = static_cast<int>(max_q * H);  // packed rows per request, fixed per graph
  const int variant = static_cast<int>(kernel);
  int row_tiles, parts;
  if (variant == ddtree::kVariantDecode) {
    // 16-row CTAs, several per SM: as many parts as CTAs that fit the GPU at once (each CTA cuts its own part of
    // the requests' tiles out of the line plan, scheduling/sched_plan.cuh: its cost grows with B, not with the parts)
    row_tiles = (rows + ddtree::kDecodeBM - 1) / ddtree::kDecodeBM;
    const int ctas = decode_ctas_per_sm > 0 ? static_cast<int>(decode_ctas_per_sm)
                                            : ddtree::mla_decode_ctas_per_sm(device, fp8, decode_deep);
    parts = std::max(1, ctas * sms / row_tiles);
  } else {
    row_tiles = (rows + ddtree::kBM - 1) / ddtree::kBM;
    parts = std::max(1, sms / row_tiles);
  }

  ddtree::MlaParams p{};
  p.q_nope = q_nope.data_ptr();
  p.q_pe = q_pe.data_ptr();
  p.q_nope_s0 = q_nope.stride(0);
  p.q_nope_s1 = q_nope.stride(1);
  p.q_pe_s0 = q_pe.stride(0);
  p.q_pe_s1 = q_pe.stride(1);
  p.q_fp16 = qdt == at::kHalf;
  p.kv = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.kv_page_stride = kv_cache.stride(0) * esz;
  p.kv_row_stride = kv_cache.stride(1) * esz;
  p.page_log2 = static_cast<int>(std::log2(static_cast<double>(page)) + 0.5);
  p.kv_fp8 = fp8;
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.qsl = query_start_loc.data_ptr<int>();
  p.tree_bits = tree_bits.data_ptr<int64_t>();
  p.scale_log2 = static_cast<float>(softmax_scale * kv_scale * ddtree::kLog2e);
  p.kv_scale = static_cast<float>(kv_scale);
  p.out = out.data_ptr();
  p.out_s0 = out.stride(0);
  p.out_s1 = out.stride(1);
  p.out_fp16 = out.scalar_type() == at::kHalf;
  p.lse = lse.data_ptr<float>();
  p.lse_s0 = lse.stride(0);
  p.lse_s1 = lse.stride(1);
  p.B = static_cast<int>(B);
  p.H = static_cast<int>(H);
  p.max_q = static_cast<int>(max_q);
  p.num_parts = parts;
  p.num_row_tiles = row_tiles;
  p.variant = variant;
  p.block_n = ddtree::mla_variant_block_n(p.variant);

  // Fixed-size scratch (depends only on B, P, max_q, H): allocation is captured once with the graph.
  const int slots = ddtree::mla_num_slots(p.B, parts);
  auto iopt = q_nope.options().dtype(at::kInt);
  auto fopt = q_nope.options().dtype(at::kFloat);
  const int64_t sched_ints = variant == ddtree::kVariantDecode ? ddtree::DecodeSplitView::size(p.B)
                                                                : ddtree::SchedView::size(p.B, parts);
  at::Tensor sched = at::empty({sched_ints}, iopt);
  const bool bf16_partials = variant == ddtree::kVariantDecode;
  at::Tensor ws_o = at::empty({slots, max_q * H, ddtree::kDV}, bf16_partials ? fopt.dtype(at::kBFloat16) : fopt);
  at::Tensor ws_lse = at::empty({slots, max_q * H}, fopt);
  p.sched = sched.data_ptr<int>();
  p.ws_o = bf16_partials ? nullptr : ws_o.data_ptr<float>();
  p.ws_o_bf16 = bf16_partials ? static_cast<uint16_t*>(ws_o.data_ptr()) : nullptr;
  p.ws_lse = ws_lse.data_ptr<float>();

  launch(p, decode_deep, pdl, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void mla_tree_verify_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, at::Tensor&,
                          at::Tensor&, int64_t, int64_t, bool, int64_t, bool) {}

}  // namespace

TORCH_LIBRARY(ddtree, m) {
  m.def(
      "mla_tree_verify(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor tree_bits, float softmax_scale, float kv_scale, Tensor(a!) out, "
      "Tensor(b!) lse, int max_query_len, int kernel, bool decode_deep, int decode_ctas_per_sm, bool pdl) -> ()");
}

TORCH_LIBRARY_IMPL(ddtree, CUDA, m) { m.impl("mla_tree_verify", &mla_tree_verify_cuda); }

TORCH_LIBRARY_IMPL(ddtree, Meta, m) { m.impl("mla_tree_verify", &mla_tree_verify_meta); }
