"""Accuracy check with lm-evaluation-harness: the same task against vLLM's OpenAI server without speculation and
with DDTree, greedy; DDTree is lossless, so the scores — and every generated answer — must be the same.

    python eval/lm_eval_check.py                          # embedded GQA pair (CPU) or MLA pair (GPU), 64 docs
    python eval/lm_eval_check.py --target T --drafter D --task-dir DIR --task NAME --limit 200

The default task runs offline: ``ddtree_stdlib_nextline`` asks for the rest of a line of Python code after a
held-out snippet of the standard library (the embedded models' held-out prompts, ``models/heldout_prompts.json``; the
prompt ends with the line's indentation), scored by exact match and chrF. ``--task-dir``/``--task`` run any lm-eval
task instead (e.g. gsm8k where its dataset is reachable).
Prints a table, writes JSON (``--out``), exits 1 when the two runs differ. The strict check is the CPU one (fp32);
in bf16 on a GPU the two runs use different attention kernels, so an answer can leave the other run's at one of the
target's own near-ties (top-two logits within bf16 rounding) — read the identical-answer count there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

MODELS = ROOT / "models"
SERVED = "ddtree-eval"
TASK = "ddtree_stdlib_nextline"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prefix}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: chrf
    aggregation: chrf
    higher_is_better: true
"""


def nextline_docs(tokenizer_dir: Path, prompts_file: Path) -> list[dict]:
    """One doc per held-out prompt whose last complete line has code: the prompt is the text before that line plus
    the line's indentation, the target is the rest of the line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    docs = []
    for ids in json.loads(prompts_file.read_text()):
        lines = tok.decode(ids, skip_special_tokens=True).split("\n")
        if len(lines) >= 3 and lines[-2].strip():
            line = lines[-2]
            indent = line[: len(line) - len(line.lstrip())]
            docs.append({"prefix": "\n".join(lines[:-2]) + "\n" + indent, "target": line.strip()})
    return docs


def write_default_task(task_dir: Path, tokenizer_dir: Path) -> None:
    data = task_dir / "stdlib_nextline.jsonl"
    docs = nextline_docs(tokenizer_dir, MODELS / "heldout_prompts.json")
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (task_dir / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))


def run_task(url: str, task: str, task_dir: Path, limit: int | None) -> tuple[dict, list[str]]:
    """lm-eval's local-completions client against ``url``: the task's metrics and its answers, in doc order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = (
        f"model={SERVED},base_url={url}/v1/completions,num_concurrent=1,max_retries=3,"
        "tokenized_requests=False,tokenizer_backend=None,eos_string=<|endoftext|>"
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir)),
        limit=limit,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    metrics = {k: v for k, v in out["results"][task].items() if isinstance(v, (int, float)) and "stderr" not in k}
    return metrics, [s["resps"][0][0] for s in samples]


def server_args(target: Path, drafter: Path | None, budget: int, gpu: bool, adaptive: bool = True) -> list[str]:
    args = [
        "--model",
        str(target),
        "--served-model-name",
        SERVED,
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
    ]
    # fp32 on the CPU: both runs then compute the target's logits the same way up to float rounding in a different
    # attention kernel, so greedy ties are as unlikely as the model allows
    args += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"] if gpu else ["--dtype", "float32"]
    if drafter is not None:
        spec = {
            "method": "ddtree",
            "model": str(drafter),
            "num_speculative_tokens": budget,
            "adaptive_budget": adaptive,
            "draft_load_config": {"load_format": "safetensors"},
        }
        args += ["--speculative-config", json.dumps(spec)]
    return args


def main() -> int:
    import torch

    from vllm_ddtree.launch import mean_acceptance_length, openai_server, spec_decode_counters

    gpu = torch.cuda.is_available()
    pair = "stdlib-mla-tiny" if gpu else "stdlib-qwen3-tiny"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=MODELS / pair)
    parser.add_argument("--drafter", type=Path, default=MODELS / f"{pair}-dflash")
    parser.add_argument("--budget", type=int, default=15, help="ddtree node budget (num_speculative_tokens)")
    parser.add_argument(
        "--fixed-budget", action="store_true", help="every step verifies the whole budget (adaptive_budget false)"
    )
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--task-dir", type=Path, help="lm-eval include path holding --task (default: the built-in)")
    parser.add_argument("--limit", type=int, default=None, help="first N docs only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = args.task_dir
        if task_dir is None:
            task_dir = Path(tmp)
            write_default_task(task_dir, args.target)
        for name, drafter in (("no speculation", None), (f"ddtree {args.budget}", args.drafter)):
            log = Path(tmp) / f"server-{len(rows)}.log"
            with openai_server(
                server_args(args.target, drafter, args.budget, gpu, not args.fixed_budget), log_path=str(log)
            ) as url:
                metrics, answers = run_task(url, args.task, task_dir, args.limit)
                accept = mean_acceptance_length(spec_decode_counters(url)) if drafter else None
            rows[name] = {"metrics": metrics, "answers": answers, "mean_acceptance_length": accept}

    (base_name, base), (spec_name, spec) = rows.items()
    same = sum(a == b for a, b in zip(base["answers"], spec["answers"], strict=True))
    n = len(base["answers"])
    print(f"task {args.task}, {n} docs, target {args.target.name}, greedy")
    print(f"{'run':>16} | " + " | ".join(f"{k:>16}" for k in base["metrics"]) + " | mean acceptance")
    for name, r in rows.items():
        acc = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "-"
        print(
            f"{name:>16} | "
            + " | ".join(f"{r['metrics'].get(k, float('nan')):>16.4f}" for k in base["metrics"])
            + f" | {acc}"
        )
    print(f"identical answers: {same}/{n}")
    ok = same == n and base["metrics"] == spec["metrics"]
    print("PASS: ddtree scores and answers equal the target's own" if ok else "FAIL: the runs differ")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "task": args.task,
                    "docs": n,
                    "target": str(args.target),
                    "drafter": str(args.drafter),
                    "budget": args.budget,
                    "device": torch.cuda.get_device_name() if gpu else "cpu",
                    "identical_answers": same,
                    base_name: base,
                    spec_name: spec,
                },
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
