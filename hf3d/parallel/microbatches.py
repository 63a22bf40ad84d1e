"""One training step (`ParallelModel.train_step`): the checks of the rows and targets, the global token
count, then forward + backward of the micro-batches, one after another or under the pipeline schedule.

Each micro-batch's objective is its token-loss sum over the global token count (the step's value is then
exactly the global token mean), plus, for a MoE model whose config asks for it, its share of stock's
load-balancing loss (hf3d.parallel.expert.RouterStats): router_aux_loss_coef times that forward's loss,
over the forwards of the step (dp ranks x micro-batches)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .expert import aux_stats, close_forward
from .pipeline import run_pipeline
from .tensor import IGNORE_INDEX
from .vocab import drop_out_of_vocab, raise_out_of_vocab, vocab_flag


def train_step(pmodel, input_ids, labels=None, position_ids=None, *, shift_labels=None, z_loss: float = 0.0):
    """`ParallelModel.train_step` (see there)."""
    if not isinstance(z_loss, (int, float)) or not z_loss >= 0.0 or z_loss == float("inf"):
        raise ValueError(f"z_loss must be a finite number >= 0 (0 turns it off), got {z_loss!r}")
    input_ids = input_ids.to(pmodel.device)
    targets, given, name = pmodel._targets(input_ids, labels, shift_labels)
    position_ids = pmodel._positions(input_ids, position_ids)
    m = pmodel.pcfg.num_microbatches
    if input_ids.shape[0] % m:
        raise ValueError(
            f"num_microbatches={m} does not divide this dp rank's batch of {input_ids.shape[0]} rows; "
            f"use a per-rank batch that is a multiple of {m}"
        )
    num_tokens = (targets != IGNORE_INDEX).sum().to(torch.float32)
    out_of_vocab = vocab_flag(pmodel, input_ids, given)
    dp_group = pmodel.mesh.get_group("dp")
    if pmodel.dp_size > 1:
        # the bad-id flag rides on the token count's all-reduce, so a bad id in one replica's rows
        # stops every replica (the ranks of one replica hold the same rows)
        counts = torch.stack([num_tokens, out_of_vocab])
        dist.all_reduce(counts, group=dp_group)
        num_tokens, out_of_vocab = counts.unbind()

    full_ids = input_ids  # the rows as given (fail() names a bad id's place in them)

    def fail() -> None:
        raise_out_of_vocab(pmodel, full_ids, given, dp_group=dp_group if pmodel.dp_size > 1 else None, labels_name=name)

    deferred = pmodel.deferred_checks and pmodel.grad_sync is not None
    if not deferred and out_of_vocab.item():
        fail()
    num_tokens = num_tokens.clamp_min(1.0)  # counted over the full rows: the global count on every cp rank
    if pmodel.grad_sync is not None:
        pmodel.grad_sync.start_step(m)
    if deferred:  # the forward of a step that opt.step() will refuse must not index outside the vocabulary
        pmodel.grad_sync.defer_check(out_of_vocab, fail)
        targets = drop_out_of_vocab(targets, pmodel.config.vocab_size)
    input_ids, targets = pmodel.cp.split(input_ids), pmodel.cp.split(targets)  # position_ids stay full

    z_loss = float(z_loss)
    start_router_stats(pmodel, full_ids.shape[0], full_ids.shape[1])
    run = run_microbatches if pmodel.pcfg.pp == 1 else run_pipeline
    sums = run(pmodel, input_ids, position_ids, targets, num_tokens, z_loss=z_loss)
    pmodel._replica_sum(sums)
    total, pmodel.last_z_loss, aux = sums.unbind()
    stats = pmodel.router_stats
    pmodel.last_aux_loss = aux / (pmodel.dp_size * m) if aux_stats(stats) is not None else None
    if stats is not None and stats.bias is not None:
        stats.update_bias(pmodel.expert_load())  # the same global load, so the same bias, on every rank
    return total


def start_router_stats(pmodel, rows: int, seq_len: int) -> None:
    """Before a step: the rows of one forward and the weight of each forward's load-balancing loss."""
    stats = pmodel.router_stats
    if stats is not None:
        stats.start_step(pmodel.device)
        m = pmodel.pcfg.num_microbatches
        stats.rows = rows // m * seq_len
        stats.coef = float(pmodel.config.router_aux_loss_coef) / (pmodel.dp_size * m)


def run_microbatches(pmodel, input_ids, position_ids, targets, num_tokens, *, z_loss: float) -> torch.Tensor:
    """[cross-entropy, z-loss, load-balancing loss], each summed over this rank's micro-batches."""
    m, stage, stats = pmodel.pcfg.num_microbatches, pmodel.stages[0], aux_stats(pmodel.router_stats)
    sums = torch.zeros(3, device=pmodel.device)
    for ids, pos, tgt in zip(input_ids.chunk(m), position_ids.chunk(m), targets.chunk(m)):
        if stats is not None:
            stats.start(None, pmodel.device)
        # no name holds the output through backward: kept alive, the logits of the plain head would be a third
        # [tokens, vocab] buffer at the peak (backward needs only the saved log-softmax)
        out = stage(ids, position_ids=pos, head=not pmodel.fused_loss)
        chain = stats.stop() if stats is not None else None
        if pmodel.fused_loss:
            objective, ce, z = pmodel.lm_head.fused_loss_terms(out, tgt, num_tokens, z_loss=z_loss)
        else:
            objective, ce, z = pmodel.lm_head.loss_terms(out.flatten(0, 1), tgt.flatten(), num_tokens, z_loss=z_loss)
        del out
        objective, aux = close_forward(stats, pmodel.cp.rank, objective, chain)
        objective.backward()
        if pmodel.grad_sync is not None:
            pmodel.grad_sync.microbatch_done()
        sums += torch.stack([ce, z, aux])
    return sums
