"""Tiny stock models of each supported family, saved as HF directories for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

VOCAB = 101  # prime: padded under every tp > 1


def tiny_config(family: str, **overrides):
    common = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if family == "llama":  # SmolLM-like: GQA 6/2 (tp=4 not valid, tp=3 replicates nothing, tp=6 valid)
        cfg = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, **common)
    elif family == "llama-kvrep":  # 4/1 heads: tp=2,4 replicate the single KV head
        cfg = LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            **common,
        )
    elif family == "qwen2":
        cfg = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **common)
    elif family == "qwen3":  # heads * head_dim (4*16=64) != hidden (48)
        cfg = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **common)
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_model_dir(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so that their layouts are exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path
