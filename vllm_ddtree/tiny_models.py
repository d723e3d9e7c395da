"""Tiny Qwen3 target + DFlash drafter (+ tokenizer) written to disk with saved random weights, for engine tests and
the smoke demo without a model hub.

Weights are random but *peaky* (large output-projection scale) so greedy decoding has clear winners: exact-equality
tests on ``load_format="dummy"`` weights would compare near-ties. Everything is float32 and seeded.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 1024
HIDDEN = 128
TARGET_LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 256
MASK_TOKEN_ID = VOCAB - 1


def _qwen3_keys(num_layers: int, hidden: int) -> dict:
    return {
        "hidden_size": hidden,
        "intermediate_size": FFN,
        "num_hidden_layers": num_layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
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


def _layer_weights(prefix: str, gen: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale / shape[-1] ** 0.5

    return {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}self_attn.q_norm.weight": torch.ones(HEAD_DIM),
        f"{prefix}self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(FFN, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(FFN, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, FFN),
        f"{prefix}input_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def write_target(path: Path, seed: int = 0, hot_tokens: int = 24) -> Path:
    """A 4-layer Qwen3ForCausalLM with peaky logits (lm_head scale 8 over unit-RMS hidden states).

    The output rows of ``hot_tokens`` ids (2..hot_tokens+1) are 3x larger, so the target mostly speaks a small
    vocabulary; the DFlash drafter shares this lm_head, so even a random drafter then proposes the target's next
    token often enough for long accepted paths (what end-to-end tests of trees need).
    """
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i in range(TARGET_LAYERS):
        weights.update(_layer_weights(f"model.layers.{i}.", gen, scale=1.0))
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) * 8.0 / HIDDEN**0.5
    weights["lm_head.weight"][2 : 2 + hot_tokens] *= 3.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_qwen3_keys(TARGET_LAYERS, HIDDEN)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_dflash_drafter(
    path: Path, block_size: int = 8, target_layer_ids: tuple[int, ...] = (1, 2), seed: int = 1
) -> Path:
    """A 1-layer DFlashDraftModel that vLLM 0.26's qwen3_dflash loader reads (embed/lm_head shared with the target)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = _layer_weights("layers.0.", gen, scale=1.0)
    weights["fc.weight"] = torch.randn(HIDDEN, HIDDEN * len(target_layer_ids), generator=gen) / HIDDEN**0.5
    weights["hidden_norm.weight"] = torch.ones(HIDDEN)
    weights["norm.weight"] = torch.ones(HIDDEN)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_qwen3_keys(1, HIDDEN),
        "block_size": block_size,
        "num_target_layers": TARGET_LAYERS,
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
