"""The oracle: stock transformers + torch.optim.AdamW + clip_grad_norm_ on the same batches."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

LR, WD, CLIP, BETAS = 2e-3, 0.1, 0.5, (0.9, 0.95)


def batches(num_steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """Token ids and labels with -100 in unequal numbers per row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_steps):
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        for r in range(batch):
            labels[r, : (r * 3) % (seq // 2) + 1] = -100
        labels[-1, seq // 2 :] = -100
        out.append((ids, labels))
    return out


def reference_run(model_dir, data, attn: str = "sdpa", param_groups=None, position_ids=None):
    """Losses, grad norms and final state dict of the stock model trained on `data`.

    param_groups(model) -> AdamW parameter groups (default: every parameter, weight decay WD).
    position_ids: the same for every batch (packed documents: stock builds the document mask from
    them when no cache is made, hence use_cache=False)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    groups = param_groups(model) if param_groups else model.parameters()
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, betas=BETAS)
    losses, norms = [], []
    for ids, labels in data:
        extra = {} if position_ids is None else dict(position_ids=position_ids, use_cache=False)
        loss = model(ids, labels=labels, **extra).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf3d_run(pmodel, data, rows: slice, **opt_kwargs):
    import hf3d

    kw = dict(lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=CLIP) | opt_kwargs
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, **kw)
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pmodel.train_step(ids[rows], labels[rows]).item())
        norms.append(opt.step().item())
        opt.zero_grad()
    return losses, norms, opt
