"""The DDTree MLA backend as a plain MLA decode backend on the H200 (``--attention-backend CUSTOM``, no speculation):
greedy output equals vLLM's FLASHMLA on a tiny DeepSeek-V3 target with the real latent dims. Run with -m gpu."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ENGINE = dict(max_model_len=1024, dtype="bfloat16", max_num_seqs=8, seed=0, skip_tokenizer_init=True,
              gpu_memory_utilization=0.05, block_size=64,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})


@pytest.fixture(scope="module", autouse=True)
def in_process_engine() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def mla_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_ddtree import tiny_models

    return tiny_models.write_mla_target(tmp_path_factory.mktemp("mla") / "target")


def _greedy(target: Path, backend: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.choice(range(2, 1000)) for _ in range(rng.randint(3, 60))]}
               for _ in range(50)]
    llm = LLM(model=str(target), attention_backend=backend, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    return out


def test_custom_backend_alone_matches_flashmla(mla_target: Path) -> None:
    want = _greedy(mla_target, "FLASHMLA")
    got = _greedy(mla_target, "CUSTOM")
    same = sum(a == b for a, b in zip(got, want, strict=True))
    print(f"CUSTOM vs FLASHMLA: {same}/{len(want)} sequences identical")
    assert same >= 0.9 * len(want)
    assert all(a[:8] == b[:8] for a, b in zip(got, want, strict=True))
