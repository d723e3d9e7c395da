"""The README's first command: serve DDTree with vLLM's OpenAI server, send one request, report, stop cleanly.

Until the embedded trained checkpoints land, the demo serves the tiny random-weight Qwen3 target + DFlash drafter
from ``vllm_ddtree.tiny_models`` (so the text is gibberish): it proves the install, the plugin, the
``"method": "ddtree"`` config and the serving path end to end, and prints the acceptance length and speed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from openai import OpenAI

from vllm_ddtree import tiny_models
from vllm_ddtree.launch import mean_acceptance_length, openai_server, spec_decode_counters

MODELS = Path(os.environ.get("DDTREE_DEMO_MODELS", Path.home() / ".cache/vllm-ddtree/demo-models-v2"))


def main() -> None:
    if not (MODELS / "target" / "tokenizer.json").exists():
        tiny_models.write_tiny_pair(MODELS)
    target, drafter = MODELS / "target", MODELS / "drafter"
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 15, "topk": 4,
            "draft_load_config": {"load_format": "safetensors"}}
    args = ["--model", str(target), "--served-model-name", "ddtree-demo", "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--speculative-config", json.dumps(spec)]
    print("serving:", " ".join(args), flush=True)
    with openai_server(args) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        start = time.perf_counter()
        out = client.completions.create(model="ddtree-demo", prompt="def shuffle(self, x):", max_tokens=64,
                                        temperature=0.0)
        elapsed = time.perf_counter() - start
        accept = mean_acceptance_length(spec_decode_counters(url))
    tokens = out.usage.completion_tokens
    print("\n--- completion ---")
    print(out.choices[0].text)
    print("------------------")
    print(f"completion tokens: {tokens}, {tokens / elapsed:.1f} tok/s (one request, CPU)")
    if accept is not None:
        print(f"mean acceptance length: {accept:.2f} tokens per verify step")
    print("server stopped")


if __name__ == "__main__":
    main()
