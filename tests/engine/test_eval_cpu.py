"""The lm-eval accuracy check (eval/lm_eval_check.py) on vLLM-CPU with the embedded GQA pair: lm-evaluation-harness
against vLLM's OpenAI server, once without speculation and once with DDTree; scores and answers must be equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not (ROOT / "models" / "stdlib-qwen3-tiny" / "model.safetensors").exists(), reason="embedded models not present"
)
def test_lm_eval_scores_equal_with_ddtree(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "eval.json"
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    res = subprocess.run(
        [sys.executable, str(ROOT / "eval" / "lm_eval_check.py"), "--limit", "16", "--budget", "7", "--fixed-budget"]
        + ["--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    base, spec = report["no speculation"], report["ddtree 7"]
    assert report["docs"] == 16 and report["identical_answers"] == 16
    assert base["metrics"] == spec["metrics"] and "exact_match,none" in base["metrics"]
    assert any(a for a in base["answers"])  # real generations, not empty lines
    assert spec["mean_acceptance_length"] > 1.0  # the drafter's tokens were accepted, so trees were verified
