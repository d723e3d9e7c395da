"""Train a tiny target on the stdlib's train split, plain next-token CE: the GQA one (4-layer Qwen3ForCausalLM) or,
with ``--arch deepseek_v3``, the MLA one (2-layer DeepseekV3ForCausalLM with the real MLA latent dims, dense MLPs).

Why: the embedded DDTree demo needs a real (trained) target so the drafter has something predictable to learn.
Deterministic: fixed seeds, fixed window sampling, single-process CPU (torch.set_num_threads(2)).

    python train/tokenizer.py --out models/stdlib-qwen3-tiny
    python train/target.py --out models/stdlib-qwen3-tiny --steps 600
    python train/target.py --arch deepseek_v3 --out models/stdlib-mla-tiny --steps 800 --batch 16
    (then copy the tokenizer files of models/stdlib-qwen3-tiny next to it: both targets share the tokenizer)
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from tokenizer import DATA_DIR, VOCAB_SIZE
from transformers import AutoModelForCausalLM, DeepseekV3Config, PretrainedConfig, Qwen3Config

# What both tiny targets share: tokenizer, width, activation, RoPE, norms, untied embeddings, special ids.
SHARED_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def make_mla_config() -> DeepseekV3Config:
    """kv_lora_rank 512 and qk_rope_head_dim 64 as in DeepSeek-V3 / Kimi-K2, so vLLM runs the MLA verify kernel;
    qk_nope_head_dim 64 / v_head_dim 128, one of the head shapes vLLM's MLA prefill (FlashAttention) accepts; 8 heads
    (the kernel's minimum); no q-LoRA and only dense MLPs (first_k_dense_replace = all layers), 2 layers to stay
    tiny."""
    return DeepseekV3Config(
        **SHARED_CONFIG,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_routed_experts=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=128,
        architectures=["DeepseekV3ForCausalLM"],
    )


def make_config() -> Qwen3Config:
    return Qwen3Config(
        **SHARED_CONFIG,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        architectures=["Qwen3ForCausalLM"],
    )


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (betas 0.9, 0.95) with a linear warmup over 4 % of the steps, then cosine to 0 (targets and drafters)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warm = max(1, steps // 25)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    return opt, sched


def optimizer_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, loss: torch.Tensor
) -> None:
    """Backward, clip the gradient norm at 1, step the optimizer and the schedule, clear the gradients."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def load_split(name: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(DATA_DIR / f"{name}.u16", dtype=np.uint16).astype(np.int64))


@torch.no_grad()
def heldout_ppl(model: torch.nn.Module, data: torch.Tensor, seq: int, max_windows: int = 10_000) -> float:
    """exp(mean CE) over non-overlapping held-out windows of length seq (every token predicted once per window)."""
    model.eval()
    n = min((data.numel() - 1) // seq, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        idx = torch.arange(i, min(i + 16, n)) * seq
        x = torch.stack([data[j : j + seq + 1] for j in idx.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/stdlib-qwen3-tiny")
    ap.add_argument("--arch", choices=("qwen3", "deepseek_v3"), default="qwen3")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true", help="timing runs")
    ap.add_argument("--export-only", action="store_true", help="round a saved checkpoint to bf16, eval, re-save")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    train, held = load_split("train"), load_split("heldout")
    if args.export_only:
        export(AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32), held, args.seq, args.out)
        return
    config: PretrainedConfig = make_mla_config() if args.arch == "deepseek_v3" else make_config()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    print(f"params {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M, train tokens {train.numel()}")
    opt, sched = make_optimizer(model, args.lr, 0.1, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + args.seq + 1] for s in starts.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        optimizer_step(model, opt, sched, loss)
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)
    print(f"train wall {time.time() - t0:.0f}s")
    if not args.no_save:
        export(model, held, args.seq, args.out)


def export(model: torch.nn.Module, held: torch.Tensor, seq: int, out: str) -> None:
    """Round to bf16 (keeps the checkpoint under the repo's size limits), report held-out ppl *of the rounded
    weights* (what vLLM serves, upcast to fp32), save as bf16."""
    model = model.to(torch.bfloat16).to(torch.float32)
    print(f"held-out ppl (bf16 weights) {heldout_ppl(model, held, seq):.2f} (seq {seq}, {held.numel()} tokens)")
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    print(f"saved -> {out}")


if __name__ == "__main__":
    main()
