"""The README's first command: serve DDTree with vLLM's OpenAI server, send one request, report, stop cleanly.

It serves an embedded pair from ``models/`` (see ``models/README.md``): on the CPU the tiny Qwen3 trained on the
Python standard library and its DFlash drafter; on a GPU the tiny DeepSeek-V3 (MLA) one, verified by DDTree's MLA
kernel under FULL CUDA graphs. It completes a held-out snippet and prints the completion, the mean acceptance length
(tokens per verify step) and tokens/s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from openai import OpenAI

from vllm_ddtree.launch import mean_acceptance_length, openai_server, spec_decode_counters

EMBEDDED = Path(__file__).resolve().parents[1] / "models"
PROMPT = 'def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):\n    """'


def model_pair(gpu: bool) -> tuple[Path, Path]:
    name = "stdlib-mla-tiny" if gpu else "stdlib-qwen3-tiny"
    target, drafter = EMBEDDED / name, EMBEDDED / f"{name}-dflash"
    for path in (target, drafter):
        if not (path / "model.safetensors").exists():
            raise SystemExit(f"{path}/model.safetensors is missing: the demo serves the pair committed in models/.")
    return target, drafter


def main() -> None:
    import torch

    gpu = torch.cuda.is_available()
    target, drafter = model_pair(gpu)
    spec = {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": 15,
        "draft_load_config": {"load_format": "safetensors"},
    }
    args = [
        "--model",
        str(target),
        "--served-model-name",
        "ddtree-demo",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
        "--speculative-config",
        json.dumps(spec),
    ]
    if gpu:  # no torch.compile, so the server is up in seconds; decode steps still replay FULL CUDA graphs
        args += [
            "--dtype",
            "bfloat16",
            "--gpu-memory-utilization",
            "0.2",
            "--compilation-config",
            json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}),
        ]
    print("serving:", " ".join(args), flush=True)
    with openai_server(args) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        # A short warm-up request first: kernels compiled on first use (Triton) stay out of the timed one.
        client.completions.create(model="ddtree-demo", prompt=PROMPT, max_tokens=16, temperature=0.0)
        before = spec_decode_counters(url)
        start = time.perf_counter()
        out = client.completions.create(model="ddtree-demo", prompt=PROMPT, max_tokens=96, temperature=0.0)
        elapsed = time.perf_counter() - start
        after = spec_decode_counters(url)
        accept = mean_acceptance_length({k: after[k] - before.get(k, 0.0) for k in after})
    tokens = out.usage.completion_tokens
    print("\n--- completion ---")
    print(out.choices[0].text)
    print("------------------")
    where = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"completion tokens: {tokens}, {tokens / elapsed:.1f} tok/s (one request, {where})")
    if accept is not None:
        print(f"mean acceptance length: {accept:.2f} tokens per verify step")
    print("server stopped")


if __name__ == "__main__":
    main()
