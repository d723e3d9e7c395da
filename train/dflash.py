"""Train a DFlash block-diffusion drafter for a tiny stdlib target (Qwen3 or DeepSeek-V3/MLA); export it in the
layout vLLM 0.26's ``qwen3_dflash`` loader reads unchanged (see docs/design/dflash-training.md).

Why this shape: the drafter forward below re-implements vLLM's inference semantics exactly (context K/V from
``hidden_norm(fc(concat of target layer outputs))`` through each layer's own k_proj/k_norm/v_proj, no
input_layernorm on context; non-causal attention over [context ; block]; neox RoPE at absolute positions; the
target's frozen embed_tokens/lm_head), so what we train is what vLLM serves.

Data is self-distilled: prompts from the stdlib split, greedy continuations by the (frozen) target, so labels are
the target's own greedy next tokens, which is what greedy speculative decoding must match.

    python train/dflash.py --target models/stdlib-qwen3-tiny --out models/stdlib-qwen3-tiny-dflash
    python train/dflash.py --target models/stdlib-mla-tiny --out models/stdlib-mla-tiny-dflash --layers 1 \
        --layer-ids 0,1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from target import load_split, make_optimizer, optimizer_step
from torch import nn
from transformers import AutoModelForCausalLM

MASK_ID = 1  # tokenizer.py: "<|mask|>"


def rope_table(pos: torch.Tensor, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style cos/sin for absolute positions pos [b, n] -> each [b, 1, n, hd]."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[..., None] * inv
    ang = torch.cat([ang, ang], -1)[:, None]
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cs[0] + torch.cat([-x2, x1], -1) * cs[1]


class Attn(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hd: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=eps)
        self.k_norm = nn.RMSNorm(hd, eps=eps)

    def kv(self, h: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(b, n, self.kv_heads, self.hd)).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.kv_heads, self.hd).transpose(1, 2)
        return rope(k, cs), v

    def forward(self, h: torch.Tensor, cs: tuple, ctx: torch.Tensor, ctx_cs: tuple, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q = rope(self.q_norm(self.q_proj(h).view(b, n, self.heads, self.hd)).transpose(1, 2), cs)
        kc, vc = self.kv(ctx, ctx_cs)  # context part: same W_k/k_norm/W_v, no input_layernorm
        kb, vb = self.kv(h, cs)
        out = F.scaled_dot_product_attention(
            q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), attn_mask=mask[:, None], enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hd: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.self_attn = Attn(d, heads, kv_heads, hd, eps)
        self.mlp = MLP(d, ffn)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, cs: tuple, ctx: torch.Tensor, ctx_cs: tuple, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cs, ctx, ctx_cs, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Parameter names equal the exported safetensors names (vLLM adds the ``model.`` prefix itself)."""

    def __init__(self, cfg: dict, n_features: int) -> None:
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.theta, self.hd = cfg["rope_parameters"]["rope_theta"], cfg["head_dim"]
        self.layers = nn.ModuleList(
            Layer(
                d,
                cfg["num_attention_heads"],
                cfg["num_key_value_heads"],
                cfg["head_dim"],
                cfg["intermediate_size"],
                eps,
            )
            for _ in range(cfg["num_hidden_layers"])
        )
        self.fc = nn.Linear(n_features * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.norm = nn.RMSNorm(d, eps=eps)

    def forward(
        self, feats: torch.Tensor, block_emb: torch.Tensor, block_pos: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """feats [b, T, |S|*d] (target layer outputs), block_emb [b, n, d], block_pos [b, n], mask [b, n, T+n]
        (True = attend). Returns final hidden states [b, n, d]; logits = target lm_head of these."""
        ctx = self.hidden_norm(self.fc(feats))
        ctx_cs = rope_table(torch.arange(feats.shape[1])[None], self.hd, self.theta)
        cs = rope_table(block_pos, self.hd, self.theta)
        x = block_emb
        for layer in self.layers:
            x = layer(x, cs, ctx, ctx_cs, mask)
        return self.norm(x)


def block_inputs(seqs: torch.Tensor, anchors: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
    """For anchors [b, N]: block ids [x_a, M...], positions a..a+B-1, labels x_{a+k}, and the attention mask:
    block j sees context t < a_j (strictly: x_a is the bonus token the target has not run yet) and its own block."""
    b, n = anchors.shape
    T = seqs.shape[1]
    off = torch.arange(bs)
    pos = (anchors[..., None] + off).reshape(b, n * bs)
    ids = torch.full((b, n, bs), MASK_ID, dtype=torch.long)
    ids[..., 0] = seqs.gather(1, anchors)
    labels = seqs.gather(1, pos).view(b, n, bs)
    ctx_mask = torch.arange(T)[None, None, :] < anchors.repeat_interleave(bs, 1)[..., None]  # [b, n*bs, T]
    blk = torch.arange(n).repeat_interleave(bs)
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return ids.view(b, n * bs), pos, labels, torch.cat([ctx_mask, own], -1)


@torch.no_grad()
def layer_outputs(target: torch.nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> list[torch.Tensor]:
    """The residual stream after each decoder layer in ``layer_ids`` (before the final norm): vLLM's aux hidden state
    for DFlash ``target_layer_id`` l. Hooks, because HF's ``hidden_states`` has the last layer's output post-norm."""
    captured: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):  # noqa: ANN202 - a forward hook
        return lambda module, args, out: captured.__setitem__(layer_id, out[0] if isinstance(out, tuple) else out)

    hooks = [target.model.layers[lid].register_forward_hook(keep(lid)) for lid in layer_ids]
    try:
        target(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [captured[lid] for lid in layer_ids]


@torch.no_grad()
def self_distill(
    target: torch.nn.Module,
    data: torch.Tensor,
    n: int,
    prompt: int,
    gen: int,
    layer_ids: list[int],
    seed: int,
    batch: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n random prompt windows + greedy continuations of the frozen target (KV cache); then one full pass for the
    context features (``layer_outputs``)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - prompt, (n,), generator=g)
    seqs, feats = [], []
    for i in range(0, n, batch):
        x = torch.stack([data[s : s + prompt] for s in starts[i : i + batch].tolist()])
        out = target(input_ids=x, use_cache=True)
        cache, toks = out.cache, [x]
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(gen):
            toks.append(nxt)
            out = target(input_ids=nxt, cache=cache, use_cache=True)
            cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        s = torch.cat(toks, 1)
        seqs.append(s)
        feats.append(torch.cat(layer_outputs(target, s, layer_ids), -1))
        print(f"  distilled {i + len(s)}/{n}", flush=True)
    return torch.cat(seqs), torch.cat(feats)


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """logits [b, N, B-1, V] for slots k=1..B-1 (slot 0, the anchor, is unsupervised); CE with
    w_k = exp(-(k-1)/gamma), normalised by the weight sum."""
    bs = labels.shape[-1]
    ce = F.cross_entropy(logits.flatten(0, -2), labels[..., 1:].flatten(), reduction="none")
    w = torch.exp(-torch.arange(bs - 1, dtype=torch.float32) / gamma)
    return (ce.view(-1, bs - 1) * w).sum() / (w.sum() * ce.numel() / (bs - 1))


@torch.no_grad()
def evaluate(
    model: DFlashDrafter,
    emb: torch.Tensor,
    head: torch.Tensor,
    seqs: torch.Tensor,
    feats: torch.Tensor,
    prompt: int,
    bs: int,
) -> tuple[list[float], float]:
    """Per-depth top-1 accuracy (slot k vs the target's greedy token) and tau_sim = 1 + mean leading run of hits,
    over every anchor of the held-out continuations."""
    model.eval()
    T = seqs.shape[1]
    anchors = torch.arange(prompt, T - bs + 1).expand(seqs.shape[0], -1)
    hits = []
    for i in range(0, seqs.shape[0], 16):
        ids, pos, labels, mask = block_inputs(seqs[i : i + 16], anchors[i : i + 16], bs)
        h = model(feats[i : i + 16].float(), F.embedding(ids, emb), pos, mask)
        pred = (h @ head.T).argmax(-1).view(labels.shape)
        hits.append((pred == labels)[..., 1:].reshape(-1, bs - 1))
    hit = torch.cat(hits).float()
    model.train()
    return hit.mean(0).tolist(), 1 + hit.cumprod(1).sum(1).mean().item()


# Attention of a drafter for an MLA target (the drafter is always a Qwen3-style GQA model).
GQA_FOR_MLA = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def draft_config(target_cfg: dict, layers: int, bs: int, layer_ids: list[int]) -> dict:
    keys = (
        "hidden_size",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "max_position_embeddings",
        "rope_parameters",
        "vocab_size",
        "tie_word_embeddings",
    )
    cfg = {k: target_cfg[k] for k in keys}
    mla = "kv_lora_rank" in target_cfg
    cfg.update(GQA_FOR_MLA if mla else {k: target_cfg[k] for k in GQA_FOR_MLA})
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **cfg,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "block_size": bs,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "target_hidden_size": target_cfg["hidden_size"],
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": layer_ids},
        "torch_dtype": "bfloat16",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="models/stdlib-qwen3-tiny")
    ap.add_argument("--out", default="models/stdlib-qwen3-tiny-dflash")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--layer-ids", default="1,2")
    ap.add_argument("--train-seqs", type=int, default=2048)
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    layer_ids = sorted(int(x) for x in args.layer_ids.split(","))
    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa").eval()
    tcfg = target.config.to_dict()
    assert max(layer_ids) < tcfg["num_hidden_layers"], f"target_layer_ids must be < {tcfg['num_hidden_layers']}"
    emb, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    tr, tf = self_distill(target, load_split("train"), args.train_seqs, args.prompt, args.gen, layer_ids, args.seed)
    ev, ef = self_distill(target, load_split("heldout"), args.eval_seqs, args.prompt, args.gen, layer_ids, 1)
    print(f"self-distilled data {time.time() - t0:.0f}s", flush=True)

    cfg = draft_config(tcfg, args.layers, args.block, layer_ids)
    model = DFlashDrafter(cfg, len(layer_ids))
    opt, sched = make_optimizer(model, args.lr, 0.0, args.steps)
    g = torch.Generator().manual_seed(args.seed)
    n_cand = args.gen - args.block + 1  # anchors a in [prompt, T-B]: every label is a target-generated token
    t1 = time.time()
    for step in range(args.steps):
        rows = torch.randint(0, tr.shape[0], (args.batch,), generator=g)
        anchors = torch.stack([torch.randperm(n_cand, generator=g)[: args.anchors] for _ in rows]) + args.prompt
        ids, pos, labels, mask = block_inputs(tr[rows], anchors.sort(1).values, args.block)
        h = model(tf[rows].float(), F.embedding(ids, emb), pos, mask)
        h = h.view(*labels.shape, -1)[:, :, 1:]
        loss = weighted_loss(h @ head.T, labels, args.gamma)
        optimizer_step(model, opt, sched, loss)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} {time.time() - t1:.0f}s", flush=True)
    print(f"train wall {time.time() - t1:.0f}s (total {time.time() - t0:.0f}s)")

    model = model.to(torch.bfloat16).to(torch.float32)  # evaluate what is exported
    acc, tau = evaluate(model, emb, head, ev, ef, args.prompt, args.block)
    print("held-out per-depth top-1:", " ".join(f"{a:.3f}" for a in acc), f"tau_sim {tau:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "eval.json").write_text(json.dumps({"per_depth_top1": acc, "tau_sim": tau}, indent=2) + "\n")
    print(f"saved -> {out}")


if __name__ == "__main__":
    main()
