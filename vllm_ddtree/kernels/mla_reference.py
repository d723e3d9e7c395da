"""fp32 PyTorch reference for ``mla_tree_verify`` over a paged latent cache (design note §4).

Slow and simple on purpose: it gathers each request's keys through the block table, applies the tree rule (all
keys before the last q_len are visible; tree key j is visible to query t iff bit j of tree_bits[t]) and computes
softmax attention in fp32. Rows are processed in chunks so long contexts stay within memory.
"""

from __future__ import annotations

import torch

from vllm_ddtree.constants import MLA_HEAD_DIM, MLA_KV_LORA_RANK


def mla_tree_verify_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_bits: torch.Tensor,
    softmax_scale: float,
    kv_scale: float = 1.0,
    row_chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [T,H,512] fp32, lse [T,H] fp32, natural log). Rows of q_len-0 requests do not exist; rows not
    covered by any request stay NaN so a test notices if the kernel is compared on them."""
    T, H, _ = q_nope.shape
    dev = q_nope.device
    fp8 = kv_cache.dtype in (torch.uint8, torch.float8_e4m3fn)
    P = kv_cache.shape[1]
    out = torch.full((T, H, MLA_KV_LORA_RANK), float("nan"), dtype=torch.float32, device=dev)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=dev)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1 = qsl[b], qsl[b + 1]
        n, L = q1 - q0, lens[b]
        if n == 0:
            continue
        nblk = -(-L // P)
        pages = block_table[b, :nblk].long()
        # gather first: keys past L (NaN padding) never enter the math
        kv = kv_cache[pages].reshape(-1, MLA_HEAD_DIM)[:L]
        kv = (kv.view(torch.float8_e4m3fn) if fp8 else kv).float() * kv_scale  # [L, 576]
        q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], -1).float().reshape(n * H, MLA_HEAD_DIM)
        bits = tree_bits[q0:q1].to(dev)
        j = torch.arange(n, device=dev)
        tree_vis = ((bits[:, None] >> j[None, :]) & 1).bool()  # [n, n]
        o_rows, l_rows = [], []
        for r0 in range(0, n * H, row_chunk):
            r1 = min(r0 + row_chunk, n * H)
            s = (q[r0:r1] @ kv.T) * softmax_scale  # [rows, L]
            node = torch.arange(r0, r1, device=dev) // H
            s[:, L - n :] = s[:, L - n :].masked_fill(~tree_vis[node], float("-inf"))
            lse_c = torch.logsumexp(s, -1)
            o_rows.append(torch.exp(s - lse_c[:, None]) @ kv[:, :MLA_KV_LORA_RANK])
            l_rows.append(lse_c)
        out[q0:q1] = torch.cat(o_rows).reshape(n, H, MLA_KV_LORA_RANK)
        lse[q0:q1] = torch.cat(l_rows).reshape(n, H)
    return out, lse
