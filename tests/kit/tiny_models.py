"""Tiny Qwen3 and DeepSeek-V3 (MLA) targets + DFlash drafter (+ tokenizer) written to disk with saved random
weights, for engine tests, benches and the smoke demo without a model hub.

Weights are random but *peaky* (large output-projection scale) so greedy decoding has clear winners: exact-equality
tests on ``load_format="dummy"`` weights would compare near-ties. Everything is float32 and seeded. The defaults are
the tests' geometry; heads, layers and (MLA) MoE layers are parameters (``bench/divergence.py`` writes other ones).
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

# the real DeepSeek-V3 / Kimi-K2 latent dims, so the MLA tree-verify kernel runs
from vllm_ddtree.constants import MLA_KV_LORA_RANK, MLA_ROPE_DIM

VOCAB = 1024
HIDDEN = 128
TARGET_LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 256
MASK_TOKEN_ID = VOCAB - 1


def _qwen3_keys(num_layers: int, hidden: int, heads: int = HEADS, kv_heads: int = KV_HEADS) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": FFN,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


# Draws seeded weights of a shape (``_rand``).
Rand = Callable[..., torch.Tensor]
# Writes one layer's attention (or MLP) weights under a name prefix, drawing them from a ``Rand``.
AttentionWeights = Callable[[str, Rand], dict[str, torch.Tensor]]
MlpWeights = Callable[[str, Rand], dict[str, torch.Tensor]]


def _rand(gen: torch.Generator) -> Rand:
    """Seeded Gaussian weights scaled by ``1 / sqrt(fan_in)``."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    return rand


def _qwen3_attention(heads: int = HEADS, kv_heads: int = KV_HEADS) -> AttentionWeights:
    def attention(prefix: str, rand: Rand) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}self_attn.q_proj.weight": rand(heads * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.k_proj.weight": rand(kv_heads * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.v_proj.weight": rand(kv_heads * HEAD_DIM, HIDDEN),
            f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, heads * HEAD_DIM),
            f"{prefix}self_attn.q_norm.weight": torch.ones(HEAD_DIM),
            f"{prefix}self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        }

    return attention


def _ffn(prefix: str, rand: Rand, width: int) -> dict[str, torch.Tensor]:
    """A SiLU-gated feed-forward block of ``width`` under ``prefix``."""
    return {
        f"{prefix}gate_proj.weight": rand(width, HIDDEN),
        f"{prefix}up_proj.weight": rand(width, HIDDEN),
        f"{prefix}down_proj.weight": rand(HIDDEN, width),
    }


def _dense_mlp(prefix: str, rand: Rand) -> dict[str, torch.Tensor]:
    return _ffn(f"{prefix}mlp.", rand, FFN)


def _moe_mlp(experts: int) -> MlpWeights:
    """A DeepSeek-V3 MoE layer: a sigmoid router over ``experts`` routed experts (zero score-correction bias) and
    one shared expert, each of width FFN."""

    def mlp(prefix: str, rand: Rand) -> dict[str, torch.Tensor]:
        weights = {
            f"{prefix}mlp.gate.weight": rand(experts, HIDDEN),
            f"{prefix}mlp.gate.e_score_correction_bias": torch.zeros(experts),
        }
        for e in range(experts):
            weights.update(_ffn(f"{prefix}mlp.experts.{e}.", rand, FFN))
        return {**weights, **_ffn(f"{prefix}mlp.shared_experts.", rand, FFN)}

    return mlp


def _layer_weights(
    prefix: str, rand: Rand, attention: AttentionWeights | None = None, mlp: MlpWeights = _dense_mlp
) -> dict[str, torch.Tensor]:
    """One decoder layer: ``attention``'s projections (Qwen3 GQA of the default heads if None), then ``mlp``'s and
    the norms."""
    attention = attention or _qwen3_attention()
    return {
        **attention(prefix, rand),
        **mlp(prefix, rand),
        f"{prefix}input_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def _write_peaky_target(
    path: Path, seed: int, hot_tokens: int, config: dict, attention: AttentionWeights, mlps: list[MlpWeights]
) -> Path:
    """A target of ``len(mlps)`` layers (layer i's MLP from ``mlps[i]``) with peaky logits: lm_head scale 8 over
    unit-RMS hidden states, and the output rows of ``hot_tokens`` ids (2..hot_tokens+1) 3x larger."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    rand = _rand(gen)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i, mlp in enumerate(mlps):
        weights.update(_layer_weights(f"model.layers.{i}.", rand, attention, mlp))
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) * 8.0 / HIDDEN**0.5
    weights["lm_head.weight"][2 : 2 + hot_tokens] *= 3.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_target(
    path: Path,
    seed: int = 0,
    hot_tokens: int = 24,
    layers: int = TARGET_LAYERS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
) -> Path:
    """A Qwen3ForCausalLM (4 layers, 4 query / 2 KV heads by default) with peaky logits (``_write_peaky_target``).

    The target then mostly speaks a small vocabulary; the DFlash drafter shares this lm_head, so even a random
    drafter proposes the target's next token often enough for long accepted paths (what end-to-end tests of trees
    need).
    """
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_qwen3_keys(layers, HIDDEN, heads, kv_heads),
    }
    return _write_peaky_target(path, seed, hot_tokens, config, _qwen3_attention(heads, kv_heads), [_dense_mlp] * layers)


MLA_HEADS = 8
MLA_NOPE_DIM = 128  # (128, 64, 128): DeepSeek-V3 dims, which vLLM's MLA prefill (FlashAttention) accepts
MLA_V_DIM = 128


def _mla_attention(heads: int) -> AttentionWeights:
    def attention(prefix: str, rand: Rand) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}self_attn.q_proj.weight": rand(heads * (MLA_NOPE_DIM + MLA_ROPE_DIM), HIDDEN),
            f"{prefix}self_attn.kv_a_proj_with_mqa.weight": rand(MLA_KV_LORA_RANK + MLA_ROPE_DIM, HIDDEN),
            f"{prefix}self_attn.kv_a_layernorm.weight": torch.ones(MLA_KV_LORA_RANK),
            f"{prefix}self_attn.kv_b_proj.weight": rand(heads * (MLA_NOPE_DIM + MLA_V_DIM), MLA_KV_LORA_RANK),
            f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, heads * MLA_V_DIM),
        }

    return attention


def write_mla_target(
    path: Path,
    seed: int = 0,
    hot_tokens: int = 24,
    layers: int = TARGET_LAYERS,
    heads: int = MLA_HEADS,
    moe_layers: int = 0,
    experts: int = 8,
) -> Path:
    """A DeepseekV3ForCausalLM (MLA, no q-LoRA; 4 layers of 8 heads with dense MLPs by default) with the same peaky
    lm_head as ``write_target``. The last ``moe_layers`` layers are MoE (``_moe_mlp``: ``experts`` routed, 2 a
    token, and one shared). ``write_dflash_drafter`` fits it (same hidden size and vocab; pass its layer count)."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "moe_intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": 1,
        "n_routed_experts": experts,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": layers - moe_layers,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "q_lora_rank": None,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "qk_nope_head_dim": MLA_NOPE_DIM,
        "v_head_dim": MLA_V_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    mlps = [_dense_mlp] * (layers - moe_layers) + [_moe_mlp(experts)] * moe_layers
    return _write_peaky_target(path, seed, hot_tokens, config, _mla_attention(heads), mlps)


def write_dflash_drafter(
    path: Path,
    block_size: int = 8,
    target_layer_ids: tuple[int, ...] = (1, 2),
    seed: int = 1,
    target_layers: int = TARGET_LAYERS,
) -> Path:
    """A 1-layer DFlashDraftModel that vLLM 0.26's qwen3_dflash loader reads (embed/lm_head shared with the target),
    for a target of ``target_layers`` layers whose ``target_layer_ids`` it reads."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _layer_weights("layers.0.", _rand(gen))
    weights["fc.weight"] = torch.randn(HIDDEN, HIDDEN * len(target_layer_ids), generator=gen) / HIDDEN**0.5
    weights["hidden_norm.weight"] = torch.ones(HIDDEN)
    weights["norm.weight"] = torch.ones(HIDDEN)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_qwen3_keys(1, HIDDEN),
        "block_size": block_size,
        "num_target_layers": target_layers,
        "target_hidden_size": HIDDEN,
        "dflash_config": {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": list(target_layer_ids)},
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer with exactly VOCAB ids, trained on Python's own ``random`` module source (offline).

    Id 0 is ``<|endoftext|>`` (bos/eos) and the last id is the DFlash mask token ``<|mask|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(inspect.getsource(random).splitlines(), trainer=trainer)
    filler = [f"<|x{i}|>" for i in range(VOCAB - 1 - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens([*filler, "<|mask|>"])
    assert tokenizer.get_vocab_size() == VOCAB and tokenizer.token_to_id("<|mask|>") == MASK_TOKEN_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(str(path))
    return path


def write_tiny_pair(root: Path, block_size: int = 8) -> tuple[Path, Path]:
    """Target (with tokenizer) and DFlash drafter under ``root``; returns (target, drafter)."""
    target = write_target(root / "target")
    write_tokenizer(target)
    return target, write_dflash_drafter(root / "drafter", block_size=block_size)
