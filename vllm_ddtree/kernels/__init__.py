"""The plugin's attention kernels behind one face: the MLA tree verify (CUDA, ``csrc/``) and its fp32 reference, the
MLA tree tail beside FlashMLA (Triton), the GQA tree attention (Triton), and the MLA dispatch table that says which
of them serves a launch. Backends, tests and benchmarks import the entry points from here; nothing is compiled or
launched on import (the CUDA extension builds on first use)."""

from vllm_ddtree.kernels.gqa_tree_attention import gqa_tree_attention, gqa_tree_attention_ref
from vllm_ddtree.kernels.mla_dispatch import FLASHMLA_PAGE, flashmla_context, split_this_launch
from vllm_ddtree.kernels.mla_reference import mla_tree_verify_ref
from vllm_ddtree.kernels.mla_tree_tail import (
    compile_pack_context_query,
    merge_context,
    mla_context_reference,
    mla_tree_tail,
    pack_context_query,
    split_verify,
)
from vllm_ddtree.kernels.ops import load_extension, mla_tree_verify

__all__ = [
    "FLASHMLA_PAGE",
    "compile_pack_context_query",
    "flashmla_context",
    "gqa_tree_attention",
    "gqa_tree_attention_ref",
    "load_extension",
    "merge_context",
    "mla_context_reference",
    "mla_tree_tail",
    "mla_tree_verify",
    "mla_tree_verify_ref",
    "pack_context_query",
    "split_this_launch",
    "split_verify",
]
