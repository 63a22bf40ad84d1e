"""The log-likelihood of continuations at the model's mesh: one forward of a batch of packed rows, the output
head only where a continuation token is predicted.

The stages run as in evaluation elsewhere (hf3d.model.ParallelModel.eval_loss): the whole stage at pp = 1,
stage after stage over pp otherwise (relay_forward, whatever the schedule's placement of stages), each rank of
a context-parallel group on its own tokens, and the last stage stops after its final norm. There the hidden
states of the full rows are put together (gathered over tp under sequence parallelism, over cp in sequence
order), the rows of the queries picked, and the vocab-parallel head runs on those alone, chunk by chunk: a
query's log-likelihood is minus its vocab-parallel cross-entropy (VocabParallelLMHead.token_losses), so no
rank ever holds full-vocabulary logits. The per-query values go to every pipeline rank in one broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.pipeline import relay_forward
from ..parallel.tensor import gather_seq, loss_chunk_rows
from .packing import Batch


@torch.no_grad()
def query_logprobs(pmodel, batch: Batch) -> torch.Tensor:
    """The log-probability of each query's token [Q] (fp32), the same on every rank of the model replica.
    Collective over the replica's tp, pp and cp ranks; the caller sets eval mode."""
    device = pmodel.device
    ids = batch.input_ids.to(device)
    positions = pmodel._positions(ids, batch.position_ids)  # checks the row length against cp and tp
    segments = batch.segments.to(device) if batch.segments is not None else None
    local_ids = pmodel.cp.split(ids)
    if pmodel.pcfg.pp == 1:
        hidden = pmodel.stages[0](local_ids, position_ids=positions, head=False, segments=segments)
    else:
        hidden = relay_forward(pmodel, local_ids, positions, head=False, segments=segments)
    out = torch.empty(batch.num_queries, dtype=torch.float32, device=device)
    if hidden is not None:
        out = _head_logprobs(pmodel, hidden, batch)
    if pmodel.pcfg.pp > 1:
        dist.broadcast(out, group=pmodel.mesh.get_group("pp"), group_src=pmodel.stage_owners[-1])
    return out


def _head_logprobs(pmodel, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """hidden: the last stage's normed output on this rank [b, s_local, h] -> log-probabilities [Q]."""
    head = pmodel.lm_head
    if pmodel.pcfg.sequence_parallel:
        hidden = gather_seq(hidden, head.group)  # [b, s/cp, h]
    hidden = pmodel.cp.gather(hidden)  # [b, S, h] in sequence order
    device = hidden.device
    picked = hidden[batch.query_rows.to(device), batch.query_cols.to(device)]  # [Q, h]
    targets = batch.query_targets.to(device)
    chunk = loss_chunk_rows(device.type, head.num_local)
    parts = [
        -head.token_losses(F.linear(picked[i : i + chunk], head.weight), targets[i : i + chunk])
        for i in range(0, len(targets), chunk)
    ]
    return torch.cat(parts) if parts else torch.empty(0, device=device)


def pair_sums(logprobs: torch.Tensor, batch: Batch, num_pairs: int) -> torch.Tensor:
    """The summed log-likelihood of each pair [num_pairs] (fp64) from one batch's query values."""
    sums = torch.zeros(num_pairs, dtype=torch.float64)
    return sums.index_add_(0, batch.query_pairs, logprobs.double().cpu())
