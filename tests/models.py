"""Tiny stock models of each supported family, saved as HF directories for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

VOCAB = 101  # prime: padded under every tp > 1


FAMILIES = {
    # SmolLM-like: tied, GQA 6/2 (valid tp: 1, 2, 3, 6; tp=6 replicates KV heads)
    "llama": (LlamaConfig, dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    # 4/1 heads: tp=2 and 4 replicate the single KV head; untied, with attention and MLP biases
    "llama-kvrep": (
        LlamaConfig,
        dict(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
        ),
    ),
    "qwen2": (Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # heads * head_dim (4 * 16 = 64) != hidden (48); tied; q_norm / k_norm
    "qwen3": (Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    # tied, GQA 4/2; every 2nd layer NoPE (no_rope_layers [1, 0, ...]) and, as stock derives layer_types,
    # sliding-window attention on those NoPE layers (window 5 < the tests' sequence lengths)
    "smollm3": (
        SmolLM3Config,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=5,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # MoE: 4 experts, top-2, renormalised, stock's load-balancing loss on (a large weight, so that it shows)
    "qwen3-moe": (
        Qwen3MoeConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            moe_intermediate_size=32,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
        ),
    ),
    # a shared expert with its sigmoid gate; layer 1 of 4 dense (mlp_only_layers), top-2 not renormalised
    "qwen2-moe": (
        Qwen2MoeConfig,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            num_hidden_layers=4,
            mlp_only_layers=[1],
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
        ),
    ),
}
MOE_FAMILIES = ("qwen3-moe", "qwen2-moe")


def tiny_config(family: str, **overrides):
    """A tiny config of `family`; overrides go to the constructor, so derived fields (layer_types) follow."""
    cls, family_kw = FAMILIES[family]
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
    return cls(**{**common, **family_kw, **overrides})


def exported(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files (one or several shards), by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no safetensors in {path}"
    return out


def make_model_dir(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so that their layouts are exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def trained_checkpoint(model_dir, root: Path) -> None:
    """Collective, at tp=2 on 2 ranks: one AdamW step of the model in `model_dir`, saved as the checkpoint
    root/ckpt and exported as root/trained (the reference a stock model loads)."""
    import hf3d

    pm = hf3d.parallelize(str(model_dir), hf3d.ParallelConfig(tp=2))
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=5e-2)
    ids = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    pm.train_step(ids, ids)
    opt.step()
    hf3d.save_checkpoint(root / "ckpt", pm, opt, step=1)
    pm.save_pretrained(root / "trained")
