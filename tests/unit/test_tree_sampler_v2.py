"""The Model Runner V2 tree sampler's glue, on the CPU under the Triton interpreter: a random V2-like batch must come
out as the accepted paths of an independent per-request oracle. vLLM's ``Sampler`` is replaced by argmax over given
logits, and vLLM's num_sampled/num_rejected kernel by the same arithmetic (vLLM-CPU switches Triton off for its own
kernels); the walk from the flat verify rows, the outputs and the handoff to the speculator are the real code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.v2

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    from types import SimpleNamespace

    import numpy as np
    import torch
    from test_verify_layout import verify_batch
    from vllm_ddtree.v2 import sampler as sampler_module
    from vllm_ddtree.v2.sampler import DDTreeRejectionSampler

    def num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len):
        return num_sampled, (cu_num_logits[1:] - cu_num_logits[:-1]).to(num_sampled.dtype) - num_sampled

    sampler_module.get_num_sampled_and_rejected = num_sampled_and_rejected

    for seed in range(8):
        step, trees, picks, inputs, want = verify_batch(seed)
        num_reqs, rows = step["num_reqs"], picks.shape[0]
        logits = torch.full((rows, 4096), -5.0)
        logits[torch.arange(rows), picks] = 5.0
        sampler = SimpleNamespace(
            compute_nans=False, logprobs_mode="raw_logprobs",
            sampling_states=SimpleNamespace(max_num_logprobs=lambda idx: -1),
            req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.zeros(16, dtype=torch.int32))),
            sample=lambda logits, *args: (logits.argmax(-1), logits),
        )
        tree_sampler = object.__new__(DDTreeRejectionSampler)
        tree_sampler.sampler, tree_sampler.budget, tree_sampler.max_depth = sampler, trees.parents.shape[1] - 1, 6
        tree_sampler._step = SimpleNamespace(trees=trees, pending_paths=None, adaptive=None)
        tree_sampler._compactors, tree_sampler._block_tables = [], None
        batch = SimpleNamespace(
            input_ids=inputs.to(torch.int32), logits_indices=torch.arange(rows), positions=torch.arange(rows),
            expanded_idx_mapping=None, idx_mapping_np=np.zeros(num_reqs, dtype=np.int32), expanded_local_pos=None,
            cu_num_logits=step["cu_num_logits"], idx_mapping=step["idx_mapping"],
            query_start_loc=step["query_start_loc"], seq_lens=torch.full((num_reqs,), 100, dtype=torch.int32),
        )
        out = tree_sampler(logits, batch)
        assert torch.equal(out.sampled_token_ids, want.output_tokens), seed
        assert torch.equal(out.num_sampled, (want.num_accepted + 1).to(torch.int32)), seed
        num_logits = step["cu_num_logits"][1:] - step["cu_num_logits"][:-1]
        assert torch.equal(out.num_rejected, num_logits - out.num_sampled), seed
        assert torch.equal(tree_sampler._step.pending_paths.accepted_nodes, want.accepted_nodes), seed
    print("ok")
    """
)


def test_v2_tree_sampler_outputs_the_oracles_paths_in_interpreter() -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "tests"), str(REPO)]),
    )
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-3000:]
