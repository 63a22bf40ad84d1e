"""The oracle: stock transformers + torch.optim.AdamW + clip_grad_norm_ on the same batches."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

# AdamW's eps (1e-5) on both sides of every comparison with the oracle. AdamW divides each gradient by its own
# magnitude plus eps, so where a gradient is near eps the float noise of its sums becomes weight noise of up to
# lr / eps times that noise. At torch's default eps (1e-8: a gain of 2e5 at LR) stock differs from itself, its
# rows only summed in reverse order, by 1.05e-5 (tests/models.py's Llama) and 2.5e-5 (its Qwen3-MoE) after 3 steps
# of batches(3, 8, 16): a bound on hf3d's weights below that would measure AdamW, not hf3d. At 1e-5 the same
# figures are 7.3e-8 and 1.5e-7; 4.5% (Llama) and 8% (MoE) of the first step's gradients lie under eps, the median
# at 2.6e-4 and 1.2e-4 (the rest of AdamW as a run sees it).
LR, WD, CLIP, BETAS, EPS = 2e-3, 0.1, 0.5, (0.9, 0.95), 1e-5
ADAMW = dict(lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)  # the oracle's AdamW settings, hf3d's the same


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


def accumulated_steps(model, opt, data, chunks: int) -> tuple[list[float], list[float]]:
    """Losses and pre-clip grad norms of `model` trained by `opt` on `data`, each step's gradient accumulated
    over `chunks` contiguous chunks of its rows (hf3d's micro-batches and dp ranks), every chunk's
    cross-entropy summed over its tokens and divided by the step's token count; clipped at CLIP."""
    losses, norms = [], []
    for ids, labels in data:
        targets = labels[:, 1:]
        n = (targets != -100).sum()
        total = 0.0
        for c_ids, c_targets in zip(ids.chunk(chunks), targets.chunk(chunks)):
            logits = model(c_ids).logits[:, :-1].flatten(0, 1).float()
            ce = torch.nn.functional.cross_entropy(logits, c_targets.flatten(), reduction="sum") / n
            ce.backward()
            total += ce.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def reference_run(model_dir, data, attn: str = "sdpa", param_groups=None, position_ids=None, optimizer=None):
    """Losses, grad norms and final state dict of the stock model trained on `data`.

    param_groups(model) -> AdamW parameter groups (default: every parameter, weight decay WD); optimizer(model) ->
    another optimizer (StockMuon).
    position_ids: the same for every batch (packed documents: stock builds the document mask from
    them when no cache is made, hence use_cache=False)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
    groups = param_groups(model) if param_groups else model.parameters()
    opt = optimizer(model) if optimizer else torch.optim.AdamW(groups, **ADAMW)
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


def moe_reference_run(model_dir, data, forwards: int, optimizer=None):
    """`reference_run` for a MoE model under hf3d's contract: each step backpropagates the cross-entropy's
    global token mean plus router_aux_loss_coef times the mean, over `forwards` contiguous chunks of the rows
    (dp ranks x micro-batches), of stock's load-balancing loss on each chunk. Returns (cross-entropy per
    step, load-balancing loss per step, grad norms, state dict in the names stock saves)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    opt = optimizer(model) if optimizer else torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, auxes, norms = [], [], []
    for ids, labels in data:
        targets = labels[:, 1:]
        n = (targets != -100).sum()
        ce, aux = 0.0, 0.0
        for c_ids, c_targets in zip(ids.chunk(forwards), targets.chunk(forwards)):
            out = model(c_ids, output_router_logits=True)
            logits = out.logits[:, :-1].flatten(0, 1).float()
            ce = ce + torch.nn.functional.cross_entropy(logits, c_targets.flatten(), reduction="sum") / n
            aux = aux + load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        aux = aux / forwards
        (ce + cfg.router_aux_loss_coef * aux).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(ce.item())
        auxes.append(aux.item())
    return losses, auxes, norms, saved_names(model.state_dict(), cfg.moe_intermediate_size)


def saved_names(state_dict: dict, inter: int) -> dict:
    """Stock's in-memory state dict with its fused experts cut into the per-expert tensors stock saves."""
    out = {}
    for k, v in state_dict.items():
        v = v.detach().clone()
        if k.endswith(".experts.gate_up_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{k[: -len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, inter:]
        elif k.endswith(".experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def dp_rows(pmodel, batch: int) -> slice:
    """This dp rank's rows of a global batch of `batch` rows: dp ranks take equal consecutive blocks."""
    per = batch // pmodel.dp_size
    return slice(pmodel.dp_rank * per, (pmodel.dp_rank + 1) * per)


def train_on(pmodel, opt, data, rows: slice) -> tuple[list[float], list]:
    """train_step and opt.step on `rows` of each (ids, labels) of `data`: the losses, and what each opt.step
    returned (the grad norm when clipping; read by the caller, so no step waits for it here)."""
    losses, norms = [], []
    for ids, labels in data:
        losses.append(pmodel.train_step(ids[rows], labels[rows]).item())
        norms.append(opt.step())
        opt.zero_grad()
    return losses, norms


def train_losses(pmodel, opt, data, batch: int) -> list[float]:
    """The losses of training on this dp rank's rows of each global batch of `batch` rows in `data`."""
    return train_on(pmodel, opt, data, dp_rows(pmodel, batch))[0]


def oracle_adamw(pmodel, **kwargs):
    """hf3d.build_optimizer with the oracle's AdamW settings (ADAMW), clipped at CLIP; kwargs: its other arguments,
    or one of those settings replaced."""
    import hf3d

    return hf3d.build_optimizer(pmodel, torch.optim.AdamW, **(ADAMW | dict(max_grad_norm=CLIP) | kwargs))


def hf3d_run(pmodel, data, rows: slice, optimizer=torch.optim.AdamW, **opt_kwargs):
    """Losses, grad norms and the optimizer of hf3d trained on `data[rows]`: by AdamW with the oracle's
    settings, or by `optimizer` with `opt_kwargs` alone (clipped at CLIP either way)."""
    import hf3d

    if optimizer is torch.optim.AdamW:
        opt = oracle_adamw(pmodel, **opt_kwargs)
    else:
        opt = hf3d.build_optimizer(pmodel, optimizer, **(dict(max_grad_norm=CLIP) | opt_kwargs))
    losses, norms = train_on(pmodel, opt, data, rows)
    return losses, [n.item() for n in norms], opt


# -- Muon: torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest ------------------------------
def stock_matrices(model) -> list[tuple[str, torch.nn.Parameter, object]]:
    """(saved name, stock parameter, index) of every 2-D matrix of the decoder layers that is neither a router nor
    a gate of one output: the hidden matrices, in the names stock saves (each expert's gate, up and down apart)."""
    inter = getattr(model.config, "moe_intermediate_size", None)
    out = []
    for k, p in model.named_parameters():
        if not k.startswith("model.layers.") or k.endswith((".mlp.gate.weight", "shared_expert_gate.weight")):
            continue
        if k.endswith(".experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(p.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", p, (e, slice(0, inter)))]
                out += [(f"{base}{e}.up_proj.weight", p, (e, slice(inter, None)))]
        elif k.endswith(".experts.down_proj"):
            out += [(f"{k[: -len('down_proj')]}{e}.down_proj.weight", p, (e,)) for e in range(p.shape[0])]
        elif p.dim() == 2:
            out.append((k, p, (slice(None),)))
    return out


class StockMuon:
    """The oracle's optimizer for Muon: each hidden matrix (stock_matrices) is a leaf of its own that
    torch.optim.Muon steps (its values and gradient copied in and back), everything else torch.optim.AdamW."""

    def __init__(self, model, muon_kwargs: dict, adamw_kwargs: dict, lr_scale=None):
        """lr_scale(name, param) -> a factor on AdamW's lr for that parameter (µP's), or None."""
        self.items = stock_matrices(model)
        self.leaves = [p.detach()[i].clone().requires_grad_() for _, p, i in self.items]
        covered = {id(p) for _, p, _ in self.items}
        rest = [(n, p) for n, p in model.named_parameters() if id(p) not in covered]
        scale = lr_scale or (lambda _n, _p: 1.0)
        groups = [dict(params=[p], lr=adamw_kwargs["lr"] * scale(n, p)) for n, p in rest]
        self.model = model
        self.muon = torch.optim.Muon(self.leaves, **muon_kwargs)
        self.adamw = torch.optim.AdamW(groups, **adamw_kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for (_, p, i), leaf in zip(self.items, self.leaves):
            leaf.grad = p.grad[i].clone()
        self.muon.step()
        for (_, p, i), leaf in zip(self.items, self.leaves):
            p[i] = leaf
        self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.model.zero_grad()


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration (torch/optim/_muon.py) in fp32 instead of bf16: patched in on both
    sides, it leaves the float noise of the gradients' reduction order at fp32 size, where bf16 would round it up."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class fp32_newton_schulz:
    """Run torch.optim.Muon's Newton-Schulz in fp32 inside the block (`newton_schulz_fp32`)."""

    def __enter__(self):
        import torch.optim._muon as muon

        self.original, muon._zeropower_via_newtonschulz = muon._zeropower_via_newtonschulz, newton_schulz_fp32

    def __exit__(self, *exc):
        import torch.optim._muon as muon

        muon._zeropower_via_newtonschulz = self.original
