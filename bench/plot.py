"""PNG charts of the committed benchmark JSON (matplotlib, a plotting-only dependency: ``pip install matplotlib``).

    python bench/plot.py step bench/results/step_time_h200_qwen3.json                # ddtree / chain step time
    python bench/plot.py step bench/results/step_time_h200_kimi_mla_full_table.json
    python bench/plot.py kernel bench/results/mla_kernel_h200_split_stream.json      # MLA verify vs baselines
    python bench/plot.py acceptance bench/results/acceptance_h200.json               # tok/s of the embedded pairs

Each writes ``<json name>.png`` beside the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _bars(ax: object, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def plot_step(data: dict, ax: object) -> None:
    rows = [r for r in data["rows"] if r["method"].startswith("ddtree")]
    cells = sorted({(r["context"], r["batch"]) for r in rows})
    configs = sorted({(r["method"], r["budget"]) for r in rows}, key=lambda c: (c[1], c[0]))
    ratio = {(r["context"], r["batch"], r["method"], r["budget"]): r["vs_chain"] for r in rows}
    labels = [f"{c // 1024}k, batch {b}" for c, b in cells]
    _bars(
        ax,
        labels,
        {f"{m} {n}": [ratio.get((c, b, m, n), 0) for c, b in cells] for m, n in configs},
        "ddtree step / V2 DFlash chain step (same width)",
    )
    ax.axhline(1.1, color="red", linestyle="--", linewidth=1, label="target 1.1")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_ylim(min(0.9, min(ratio.values()) - 0.05), max(1.2, max(ratio.values()) + 0.05))
    ax.set_title(f"Decode step on {data['machine']}, Model Runner V2, FULL graphs ({data['target']['name']})")


def plot_kernel(data: dict, ax: object) -> None:
    """One group of bars per shape: our kernel per variant (auto: the decode kernel at few rows a request, else
    sm_90's resident-V; the <= 99 KB portable one that sm_80 and sm_120 build; the decode kernel forced), the Hopper
    split and the two vLLM baselines."""
    shapes = list(dict.fromkeys((r["B"], r["L"], r["H"], r["N"]) for r in data["rows"]))
    by = {(r["B"], r["L"], r["H"], r["N"], r.get("variant", "auto")): r for r in data["rows"]}
    labels = [f"B{b} L{n_l // 1024}k\nH{h} N{n}" for b, n_l, h, n in shapes]
    first = [next(r for k, r in by.items() if k[:4] == shape) for shape in shapes]
    series = {}
    variants = (
        ("auto", "our CUDA kernel, auto (sm_90)"),
        ("portable", "our CUDA kernel, portable"),
        ("decode", "our decode kernel, forced"),
        ("decode-shallow", "our decode kernel, sm_120 ring"),
    )
    for variant, name in variants:
        if all((*shape, variant) in by for shape in shapes):
            series[name] = [by[(*shape, variant)]["us"] for shape in shapes]
    if all("ours_hopper_us" in r for r in first):
        series["ours, Hopper split (FlashMLA context + tree tail)"] = [r["ours_hopper_us"] for r in first]
    series["vLLM Triton MLA (tree as rows)"] = [r["triton_mla_us"] for r in first]
    series["FlashMLA causal (no tree mask)"] = [r["flashmla_causal_us"] for r in first]
    if all("floor_us" in r for r in first):  # measured copy rate and GEMM / mma.sync rates (bench/compute_rates.py)
        series["floor at the bf16 GEMM rate"] = [r["floor_us"] for r in first]
        series["floor at the mma.sync peak"] = [r["floor_mma_sync_us"] for r in first]
    _bars(ax, labels, series, "µs (median, graph replay)")
    ax.set_title(f"MLA tree verify on {data['device']}")


def _config_name(method: str, budget: int) -> str:
    return {"none": "no spec", "dflash": f"DFlash chain {budget}"}.get(method, f"ddtree {budget}")


def plot_acceptance(data: dict, ax: object) -> None:
    rows = data["rows"]
    groups = sorted({(r["pair"], r["batch"]) for r in rows})
    order = {"none": 0, "dflash": 1, "ddtree": 2}
    configs = sorted({(r["method"], r["budget"]) for r in rows}, key=lambda c: (order[c[0]], c[1]))
    value = {(r["pair"], r["batch"], r["method"], r["budget"]): r["tok_per_s"] for r in rows}
    series = {_config_name(m, n): [value.get((p, b, m, n), 0) for p, b in groups] for m, n in configs}
    _bars(ax, [f"{p} pair, batch {b}" for p, b in groups], series, "output tokens / s")
    ax.set_title("Embedded trained pairs, held-out prompts, greedy")


PLOTS = {"step": plot_step, "kernel": plot_kernel, "acceptance": plot_acceptance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(PLOTS))
    parser.add_argument("json", type=Path)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    PLOTS[args.kind](json.loads(args.json.read_text()), ax)
    fig.tight_layout()
    out = args.json.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
