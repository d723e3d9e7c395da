"""The Triton kernels of the V2 verify step compile for real GPUs (sm_80, sm_90, sm_120), on a machine without one.

The Triton interpreter (what the CPU tests run) checks the math but not the compiler: types in ``tl.dot``, loop
bounds, register pressure. Triton can compile ahead of time for a named target with its bundled ``ptxas``, so CI
compiles each kernel at the shapes the backends launch and reports registers and spills."""

from __future__ import annotations

import pytest

ARCHS = [80, 90, 120]


def _compile(
    fn: object, signature: dict[str, str], constexprs: dict[str, object], arch: int, num_warps: int = 4
) -> object:
    import triton
    from triton.backends.compiler import GPUTarget

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps},
    )


def _check(kernel: object, label: str, no_spills: bool = True) -> None:
    """A cubin came out, and (``no_spills``) it keeps everything in registers (no stack frame: spills live there)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton.backends.nvidia

    cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True, check=True)
    fields = dict(f.split(":", 1) for line in usage.stdout.splitlines() if "REG:" in line for f in line.split())
    print(label, fields["REG"], "registers, stack", fields["STACK"], "bytes")
    assert not no_spills or fields["STACK"] == "0", f"{label}: {fields['STACK']}-byte stack ({fields['REG']} registers)"


@pytest.mark.parametrize("arch", ARCHS)
def test_walk_kernel_compiles(arch: int) -> None:
    from vllm_ddtree.accept import _walk_kernel

    signature = {
        "pick_ptr": "*i64",
        "input_ptr": "*i32",
        "cu_ptr": "*i32",
        "row_ptr": "*i32",
        "par_ptr": "*i64",
        "anc_ptr": "*i64",
        "num_ptr": "*i64",
        "acc_ptr": "*i64",
        "num_acc_ptr": "*i64",
        "out_ptr": "*i64",
        "num_sampled_ptr": "*i32",
        "trash_row": "i32",
        "max_depth": "i32",
    }
    _check(_compile(_walk_kernel, signature, {"BUDGET": 63, "BLOCK": 64, "COLS": 16}, arch, 2), f"walk sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
def test_path_context_kernel_compiles(arch: int) -> None:
    from vllm_ddtree.v2.verify_layout import _path_context_kernel

    signature = {
        "positions": "*i64",
        "h0": "*bf16",
        "h1": "*bf16",
        "h2": "*bf16",
        "h3": "*bf16",
        "row_stride": "i32",
        "dim": "i32",
        "query_start_loc": "*i32",
        "cu_num_logits": "*i32",
        "idx_mapping": "*i32",
        "accepted_nodes": "*i64",
        "acc_stride": "i32",
        "num_accepted": "*i64",
    }
    constexprs = {"NUM_H": 3, "RESTORE": True, "MAX_W": 64, "BLOCK": 1024}
    _check(_compile(_path_context_kernel, signature, constexprs, arch), f"path context sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 8, 16])
@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
def test_draft_topk_kernels_compile(arch: int, k: int, logits: str) -> None:
    import triton

    from vllm_ddtree.draft_topk import MIN_SLICE, _merge_topk_kernel, _slice_topk_kernel

    kp = triton.next_power_of_2(k)
    signature = {
        "logits": logits,
        "row_stride": "i32",
        "vocab": "i32",
        "part_vals": "*fp32",
        "part_ids": "*i32",
        "part_stats": "*fp32",
        "num_slices": "i32",
    }
    constexprs = {"K": k, "KP": kp, "SLICE": MIN_SLICE, "WIDE": logits == "*fp32"}
    _check(_compile(_slice_topk_kernel, signature, constexprs, arch, 8), f"topk slices k{k} sm_{arch}")
    signature = {
        "part_vals": "*fp32",
        "part_ids": "*i32",
        "part_stats": "*fp32",
        "num_slices": "i32",
        "vocab": "i32",
        "out_logprobs": "*fp32",
        "out_ids": "*i64",
    }
    constexprs = {"K": k, "KP": kp, "SP": 64}
    _check(_compile(_merge_topk_kernel, signature, constexprs, arch), f"topk merge k{k} sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("v_split", [1, 4, 8])
@pytest.mark.parametrize("keys", [16, 64])
def test_mla_tree_tail_kernel_compiles(arch: int, heads: int, v_split: int, keys: int) -> None:
    from vllm_ddtree.kernels.mla_tree_tail import BLOCK_M, CHUNK, NUM_WARPS, _mla_tree_tail_kernel

    pointers = {
        "q_nope_ptr": "*bf16",
        "q_pe_ptr": "*bf16",
        "kv_ptr": "*bf16",
        "bt_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32",
        "bits_ptr": "*i64",
        "out_ptr": "*bf16",
        "lse_ptr": "*fp32",
        "qk_scale": "fp32",
    }
    strides = ["s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_blk", "s_tok", "s_bt", "s_o_t", "s_o_h", "s_l_t"]
    signature = {**pointers, **dict.fromkeys(strides, "i32")}
    constexprs = {
        "NUM_HEADS": heads,
        "PAGE": 64,
        "BLOCK_M": BLOCK_M,
        "KEYS": keys,
        "CHUNK": CHUNK,
        "V_SPLIT": v_split,
        "F32_DOT": False,
        "ROOT_IN_CONTEXT": True,
    }
    kernel = _compile(_mla_tree_tail_kernel, signature, constexprs, arch, NUM_WARPS)
    _check(kernel, f"mla tail H{heads} keys {keys} V/{v_split} sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", [8, 64, 128])
def test_mla_context_merge_kernel_compiles(arch: int, heads: int) -> None:
    from vllm_ddtree.kernels.mla_tree_tail import MERGE_ROWS, MERGE_WARPS, _merge_context_kernel

    pointers = {
        "context_out_ptr": "*bf16",
        "context_lse_ptr": "*fp32",
        "tree_out_ptr": "*bf16",
        "tree_lse_ptr": "*fp32",
        "qsl_ptr": "*i32",
        "out_ptr": "*bf16",
        "lse_ptr": "*fp32",
    }
    strides = [
        "s_co_b",
        "s_co_q",
        "s_co_h",
        "s_cl_b",
        "s_cl_h",
        "s_cl_q",
        "s_to_t",
        "s_to_h",
        "s_tl_t",
        "s_o_t",
        "s_o_h",
        "s_l_t",
    ]
    signature = {**pointers, **dict.fromkeys(strides, "i32")}
    kernel = _compile(_merge_context_kernel, signature, {"NUM_HEADS": heads, "ROWS": MERGE_ROWS}, arch, MERGE_WARPS)
    _check(kernel, f"mla merge H{heads} sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_layout_kernel_compiles(arch: int) -> None:
    from vllm_ddtree.v2.verify_layout import _verify_layout_kernel

    signature = {
        "positions": "*i64",
        "token_bits": "*i64",
        "query_start_loc": "*i32",
        "cu_num_logits": "*i32",
        "idx_mapping": "*i32",
        "tree_depth": "*i64",
        "tree_anc": "*i64",
        "tree_stride": "i32",
    }
    _check(_compile(_verify_layout_kernel, signature, {"MAX_W": 64}, arch, 1), f"layout sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("width", [16, 64])
@pytest.mark.parametrize("has_prefix", [True, False])
def test_gqa_tree_attention_kernel_compiles(arch: int, width: int, has_prefix: bool) -> None:
    """Qwen3-4B's attention (32 query heads over 8 KV heads, head 128, bf16) at the tiles the launcher picks on
    that GPU for tree widths 16 and 64: tail-only after FlashAttention's context, and whole-context. None spills."""
    import torch

    from vllm_ddtree.kernels.gqa_tree_attention import _gqa_tree_attn_kernel, tile_config

    block_m, block_n, num_warps, _ = tile_config(128, torch.bfloat16, 4, width, has_prefix, hopper=arch == 90)
    pointers = {
        "q_ptr": "*bf16",
        "kv_ptr": "*bf16",
        "bt_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32",
        "bits_ptr": "*i64",
        "out_ptr": "*bf16",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "prefix_out_ptr": "*bf16",
        "prefix_lse_ptr": "*fp32",
        "num_reqs": "i32",
        "num_rows": "i32",
        "qk_scale": "fp32",
    }
    strides = ["s_qt", "s_qh", "s_blk", "s_kvh", "s_tok", "s_bt", "s_ot", "s_oh", "s_pt", "s_ph", "s_lh"]
    constexprs = {
        "NUM_Q_HEADS": 32,
        "GROUP": 4,
        "HEAD_D": 128,
        "BLOCK_Q": block_m // 4,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_R": 16,
        "PAGE": 16,
        "NUM_SPLITS": 1 if has_prefix else 4,
        "DOT_PREC": "tf32",
        "F32_DOT": False,
        "HAS_PREFIX": has_prefix,
    }
    kernel = _compile(_gqa_tree_attn_kernel, {**pointers, **dict.fromkeys(strides, "i32")}, constexprs, arch, num_warps)
    _check(kernel, f"gqa W{width} M{block_m} N{block_n} prefix={has_prefix} sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gather", [False, True])
def test_pack_context_query_kernel_compiles(arch: int, gather: bool) -> None:
    from vllm_ddtree.kernels.mla_tree_tail import PACK_HEADS, PACK_WARPS, _pack_query_kernel

    signature = {
        "q_nope_ptr": "*bf16",
        "q_pe_ptr": "*bf16",
        "rows_ptr": "*i64",
        "out_ptr": "*bf16",
        "s_qn_t": "i32",
        "s_qn_h": "i32",
        "s_qp_t": "i32",
        "s_qp_h": "i32",
        "s_o_t": "i32",
        "s_o_h": "i32",
        "num_heads": "i32",
    }
    constexprs = {"NOPE": 512, "ROPE": 64, "HEADS": PACK_HEADS, "GATHER": gather}
    _check(_compile(_pack_query_kernel, signature, constexprs, arch, PACK_WARPS), f"pack query sm_{arch}")
