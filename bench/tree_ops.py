"""Time DDTree's per-step tree ops on the GPU under CUDA-graph replay, against the heap reference on the CPU.

Ops: the drafter's per-depth top-k log-probs over a 163,840-token vocabulary (``draft_topk``'s Triton kernel vs
torch's topk + logsumexp), tree build and acceptance walk (fused Triton kernels and the pure-torch paths), KV
compaction (DeepSeek-V3 MLA cache, 61 layers, and a Qwen3-8B GQA cache, 36 layers), and build + walk + compaction
as one graph. Prints a table and writes JSON.

    python bench/tree_ops.py --out bench/results/tree_ops_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/meta.py

from meta import run_meta  # noqa: E402

from vllm_ddtree.accept import walk_trees, walk_trees_torch  # noqa: E402
from vllm_ddtree.draft_topk import topk_logprobs, topk_logprobs_reference  # noqa: E402
from vllm_ddtree.kv_compact import KVCompactor  # noqa: E402
from vllm_ddtree.tree import build_trees, build_trees_reference, build_trees_torch  # noqa: E402

D, K = 15, 8
VOCAB = 4096
DRAFT_VOCAB = 163840  # Kimi-K2's vocabulary: the drafter's per-depth top-k reads [batch * D, DRAFT_VOCAB] logits


def topk_logprobs_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the drafter ran before ``draft_topk``: torch's topk and a float32 logsumexp."""
    values, ids = logits.topk(k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), ids


def gpu_median_us(fn: Callable[[], object], replays_per_sample: int = 20, samples: int = 30) -> float:
    """Median µs per call of ``fn`` captured once in a CUDA graph and replayed back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays_per_sample):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays_per_sample)
    return statistics.median(times)


def cpu_median_us(fn: Callable[[], object], samples: int = 7) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def draft_topk(batch: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-K log-probs of a drafter-like distribution (peaked logits over a small vocabulary)."""
    logits = torch.randn(batch, D, VOCAB, generator=gen) * 3.0
    logprobs, ids = torch.log_softmax(logits, dim=-1).topk(K, dim=-1)
    return logprobs.to(device), ids.to(device)


def target_choices(trees, gen: torch.Generator, match_rate: float = 0.7) -> torch.Tensor:
    """Target tokens per node: with probability ``match_rate`` the token of the node's best child (long paths)."""
    batch, width = trees.parents.shape
    device = trees.parents.device
    is_child = trees.parents[:, None, 1:] == torch.arange(width, device=device)[None, :, None]  # [B, node, child]
    best_child = is_child.int().argmax(dim=-1)  # nodes come in score order: the first child is the best one
    best_token = torch.gather(trees.node_tokens, 1, best_child)
    noise = torch.randint(0, VOCAB, (batch, width), generator=gen).to(device)
    keep = (torch.rand(batch, width, generator=gen) < match_rate).to(device) & is_child.any(dim=-1)
    return torch.where(keep, best_token, noise)


def make_caches(kind: str, layers: int, num_blocks: int, device: str) -> tuple[list[torch.Tensor], int, int]:
    if kind == "mla":  # DeepSeek-V3 / Kimi-K2 latent cache: [num_blocks, 64, 576] bf16
        return [torch.zeros(num_blocks, 64, 576, dtype=torch.bfloat16, device=device) for _ in range(layers)], 0, 1
    # Qwen3-8B GQA cache, logical (num_blocks, kv_heads=8, block_size=16, 2*head=256), HND
    return [torch.zeros(num_blocks, 8, 16, 256, dtype=torch.bfloat16, device=device) for _ in range(layers)], 0, 2


def bench_case(batch: int, budget: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(batch * 1000 + budget)
    width = budget + 1
    logprobs, ids = draft_topk(batch, device, gen)
    row = {"batch": batch, "depth": D, "topk": K, "budget": budget}

    row["build_triton_us"] = gpu_median_us(lambda: build_trees(logprobs, ids, budget))
    row["build_torch_us"] = gpu_median_us(lambda: build_trees_torch(logprobs, ids, budget))
    trees = build_trees(logprobs, ids, budget)
    choices = target_choices(trees, gen)
    row["walk_us"] = gpu_median_us(
        lambda: walk_trees(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, choices, D)
    )
    row["walk_torch_us"] = gpu_median_us(
        lambda: walk_trees_torch(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, choices, D)
    )
    paths = walk_trees(trees.node_tokens, trees.parents, trees.anc_bits, trees.num_nodes, choices, D)
    row["mean_accepted"] = paths.num_accepted.float().mean().item()
    query_start_loc = torch.arange(0, (batch + 1) * width, width, dtype=torch.int32, device=device)
    for kind, layers in (("mla", 61), ("gqa", 36)):
        caches, block_dim, offset_dim = make_caches(
            kind, layers, batch * 2 * 64 // (64 if kind == "mla" else 16) + 8, device
        )
        block_size = caches[0].shape[offset_dim]
        num_slots = caches[0].shape[block_dim] * block_size
        slot_mapping = (torch.randperm(num_slots - block_size, generator=gen)[: batch * width] + block_size).to(device)
        compactor = KVCompactor(caches, block_dim, offset_dim, max_num_reqs=batch, max_path_len=D)
        row[f"compact_{kind}_{layers}l_us"] = gpu_median_us(
            lambda c=compactor, s=slot_mapping: c(s, query_start_loc, paths.accepted_nodes, paths.num_accepted)
        )
        if kind == "mla":

            def whole_step(c=compactor, s=slot_mapping) -> None:
                t = build_trees(logprobs, ids, budget)
                p = walk_trees(t.node_tokens, t.parents, t.anc_bits, t.num_nodes, choices, D)
                c(s, query_start_loc, p.accepted_nodes, p.num_accepted)

            row["step_build_walk_compact_mla_us"] = gpu_median_us(whole_step)
        del caches, compactor
    logits = torch.randn(batch * D, DRAFT_VOCAB, device=device, dtype=torch.bfloat16) * 3.0
    row["topk_triton_us"] = gpu_median_us(lambda: topk_logprobs(logits, K))
    row["topk_torch_us"] = gpu_median_us(lambda: topk_logprobs_torch(logits, K))
    assert torch.equal(topk_logprobs(logits, K)[1], topk_logprobs_reference(logits, K)[1])
    if batch <= 32:
        cpu_lp, cpu_ids = logprobs.cpu(), ids.cpu()
        row["heap_reference_cpu_us"] = cpu_median_us(lambda: build_trees_reference(cpu_lp, cpu_ids, budget))
    assert torch.equal(build_trees_torch(logprobs, ids, budget).parents, trees.parents)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tree_ops.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 63])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/tree_ops.py times CUDA-graph replays and needs a CUDA GPU")
    rows = [bench_case(b, n, "cuda") for b in args.batches for n in args.budgets]
    cols = [
        "batch",
        "budget",
        "topk_triton_us",
        "topk_torch_us",
        "build_triton_us",
        "build_torch_us",
        "walk_us",
        "walk_torch_us",
        "compact_mla_61l_us",
        "compact_gqa_36l_us",
        "step_build_walk_compact_mla_us",
        "heap_reference_cpu_us",
        "mean_accepted",
    ]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(
            " | ".join(
                f"{r.get(c, float('nan')):>14.1f}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>14}"
                for c in cols
            )
        )
    result = {
        "meta": run_meta(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "timing": "median µs per call, CUDA-graph replay (20 replays x 30 samples); heap reference: CPU, median of 7",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
