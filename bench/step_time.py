"""Decode step time on Model Runner V2: no speculation vs vLLM's DFlash chain vs DDTree, side by side in one run.

The target is a Qwen3-architecture model with dummy weights (Qwen3-4B geometry by default) and the drafter a dummy
DFlash model, so the drafter's proposals are essentially never accepted: every step emits one token per request and
the time per output token *is* the step time (verify + sample + draft). Each configuration runs in its own process;
for every (context, batch) it prefills once (prefix-cached), then times ``generate`` with 1 and with 1+N output
tokens, repeated, and reports the median of (t[1+N] - t[1]) / N. Decode steps replay FULL CUDA graphs.

    python bench/step_time.py --budgets 8 16 --contexts 4096 32768 --batches 1 16 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
DRAFT_LAYERS = 2
DRAFT_BLOCK = 16


def _qwen3(layers: int, **extra: object) -> dict:
    return {"model_type": "qwen3", **QWEN3_4B, "num_hidden_layers": layers, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, **extra}


def write_models(root: Path) -> tuple[Path, Path]:
    """Config-only target and drafter (weights are vLLM's dummy init)."""
    target, drafter = root / "target", root / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], **_qwen3(36)}))
    layers = QWEN3_4B["num_hidden_layers"]
    (drafter / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], **_qwen3(DRAFT_LAYERS), "block_size": DRAFT_BLOCK,
        "num_target_layers": layers, "target_hidden_size": QWEN3_4B["hidden_size"],
        "dflash_config": {"mask_token_id": QWEN3_4B["vocab_size"] - 1,
                          "target_layer_ids": [1, layers // 2, layers - 3]},
    }))  # fmt: skip
    return target, drafter


def _timed(llm: object, prompts: list[dict], tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_one(args: argparse.Namespace) -> None:
    """Child process: one engine, every (context, batch); prints one JSON line per measurement."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    target, drafter = write_models(Path(args.workdir))
    width = 1 + args.budget if args.method != "none" else 1
    spec = None
    if args.method != "none":
        spec = {"method": args.method, "model": str(drafter), "num_speculative_tokens": args.budget}
    max_batch = max(args.batches)
    llm = LLM(
        model=str(target), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
        max_model_len=max(args.contexts) + 512, max_num_seqs=max_batch, gpu_memory_utilization=0.85,
        speculative_config=spec, enable_prefix_caching=True,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                            "cudagraph_capture_sizes": sorted({b * width for b in args.batches})},
    )  # fmt: skip
    for context in args.contexts:
        for batch in args.batches:
            prompts = [{"prompt_token_ids": [(7 * i + 13 * r) % 150000 + 2 for i in range(context)]}
                       for r in range(batch)]

            _timed(llm, prompts, 1 + args.steps)  # prefill into the prefix cache, warm every graph
            samples = []
            for _ in range(args.repeats):
                short, long = _timed(llm, prompts, 1), _timed(llm, prompts, 1 + args.steps)
                samples.append((long - short) / args.steps)
            row = {"method": args.method, "budget": args.budget if spec else 0, "width": width, "context": context,
                   "batch": batch, "step_ms": 1e3 * statistics.median(samples),
                   "samples_ms": [round(1e3 * s, 4) for s in samples]}
            print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 63])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip the no-speculation engine")
    parser.add_argument("--out", type=Path, default=Path("bench/results/step_time_h200.json"))
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.method, args.budget = args.one[0], int(args.one[1])
        run_one(args)
        return
    configs = ([] if args.no_baseline else [("none", 0)]) + [(m, b) for b in args.budgets for m in ("dflash", "ddtree")]
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        for method, budget in configs:
            cmd = [sys.executable, __file__, "--one", method, str(budget), "--workdir", workdir, "--steps",
                   str(args.steps), "--repeats", str(args.repeats), "--contexts", *map(str, args.contexts),
                   "--batches", *map(str, args.batches)]  # fmt: skip
            # Stream the child's results: a run cut short still leaves every finished row on disk and on screen.
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
                for line in proc.stdout:
                    if line.startswith("RESULT "):
                        rows.append(json.loads(line[7:]))
                        print(line.strip(), flush=True)
                        _write(args.out, rows)
                err = proc.stderr.read()
            if proc.returncode:
                print(f"{method} budget {budget} failed (rc {proc.returncode}):\n{err[-3000:]}", flush=True)
    _write(args.out, rows)
    print(f"{'method':8} {'budget':>6} {'ctx':>6} {'batch':>5} {'step ms':>8} {'vs chain':>8}")
    for r in rows:
        ratio = f"{r['vs_chain']:.3f}" if r.get("vs_chain") else ""
        print(f"{r['method']:8} {r['budget']:>6} {r['context']:>6} {r['batch']:>5} {r['step_ms']:>8.3f} {ratio:>8}")


def _write(path: Path, rows: list[dict]) -> None:
    """The JSON report, with each ddtree row's ratio to the chain step of the same width, context and batch."""
    chain = {(r["budget"], r["context"], r["batch"]): r["step_ms"] for r in rows if r["method"] == "dflash"}
    for r in rows:
        ref = chain.get((r["budget"], r["context"], r["batch"])) if r["method"] == "ddtree" else None
        r["vs_chain"] = round(r["step_ms"] / ref, 3) if ref else None
    path.write_text(json.dumps({"machine": "H200", "target": "Qwen3-4B geometry, dummy weights, bf16",
                                "drafter": f"DFlash {DRAFT_LAYERS} layers, block {DRAFT_BLOCK}, dummy",
                                "graphs": "FULL_DECODE_ONLY, no torch.compile", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
