"""The ZeRO-3 optimizer: the wrapped torch optimizer over FSDP2's shards (hf3d/parallel/fsdp.py).

FSDP2 holds each parameter as an fp32 dim-0 shard and reduce-scatters its gradient into an fp32 shard of the same
rows; this optimizer steps the shards in place. They are the master weights (`_masters` views their storage, so
the next all-gather sees the update, and nothing is written back). What FSDP2 does not know about is done here
before the norm, on the shards, as ZeRO-0/1/2 do it on whole buckets: the gradients a tp rank computes only in
part (norms under sequence parallelism, replicated KV heads) summed over tp, and those of tied embeddings held on
two pipeline ranks summed over the pair. Sums commute, so summing after FSDP2's reduction over dp is exact.

Addressing: every parameter gets a flat range of its own (`_flat_range`) in a coordinate of this optimizer's, and
its shard [r0 * cols, r1 * cols) of it; the checkpoint's boxes and the state dict read them as ZeRO-1's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..parallel.fsdp import first_replica, gathered_bytes, local_grad, local_shard, reshard_all
from .base import ParallelOptimizer, merge_ranges, owned_runs, tied_embedding_group
from .grad_buffer import sum_partial_over_tp


class ShardedOptimizer(ParallelOptimizer):
    """Wraps a torch optimizer class around FSDP2's fp32 shards (ZeRO-3), with global-norm clipping over the mesh."""

    zero_stage = 3

    def __init__(
        self,
        pmodel,
        optimizer_cls,
        *,
        max_grad_norm: float | None,
        exclude_from_weight_decay: bool | Callable[[str, torch.Tensor], bool],
        optimizer_kwargs: dict,
    ):
        self.pmodel, self.max_grad_norm = pmodel, max_grad_norm
        named = pmodel.unique_parameters()
        self.names = {id(p): n for n, p in named}
        self.device = pmodel.device
        # the shards are fp32 master weights; with another compute dtype a checkpoint also writes them as "master"
        self._aliased = pmodel.param_dtype == torch.float32
        self.tp_group, self.tied_group = pmodel.mesh.get_group("tp"), tied_embedding_group(pmodel)
        self._flat_range: dict[int, tuple[int, int]] = {}
        self._masters: list[tuple[nn.Parameter, torch.Tensor, int, int]] = []  # (param, its shard, lo, hi)
        self._owned: list[list[tuple[int, int]]] = []  # per master: owned runs, relative to the shard
        base = 0
        for _, p in named:
            self._flat_range[id(p)] = (base, base + p.numel())
            flat, start = local_shard(p)
            if flat.numel():
                self._masters.append((p, flat, base + start, base + start + flat.numel()))
                stop = start + flat.numel()
                runs = [
                    (max(a, start) - start, min(z, stop) - start) for a, z in owned_runs(p) if a < stop and start < z
                ]
                self._owned.append(runs if first_replica(p) else [])
            base += p.numel()
        self._grads: list[torch.Tensor] = []
        self._norm_views: list[torch.Tensor] = []
        grouped, with_no_decay = self._grouped(exclude_from_weight_decay)
        self._wrap(pmodel, optimizer_cls, optimizer_kwargs, grouped, with_no_decay=with_no_decay)

    def written_range(self, param: nn.Parameter) -> tuple[int, int]:
        """This rank's shard of `param` (on the first replica of each shard under HSDP)."""
        if not first_replica(param):
            return 0, 0
        flat, start = local_shard(param)
        base = self._flat_range[id(param)][0]
        return base + start, base + start + flat.numel()

    # -- gradient path -----------------------------------------------------------------------------
    def finish_grad_sync(self) -> None:
        """The shards' gradients as the step reads them: summed over tp where each tp rank has a part, over the
        pair of a tied embedding, zeros where no backward reached a parameter."""
        tp = self.tp_group.size()
        self._grads, self._norm_views, tied = [], [], []
        for (p, master, _, _), owned in zip(self._masters, self._owned):
            g = local_grad(p)
            if g is None:  # no backward reached it: it steps with a zero gradient, as under ZeRO-0/1/2
                g = torch.zeros_like(master)
            if tp > 1:
                rows = g.view(-1, *p.shape[1:])
                sum_partial_over_tp(p, rows, local_shard(p)[1] // _row(p), self.tp_group, self.pmodel.hf_shapes)
            if getattr(p, "hf3d_tied_copy", False) or (_is_embedding(p) and self.pmodel.config.tie_word_embeddings):
                tied.append(g)
            self._grads.append(g)
            self._norm_views += [g[a:z] for a, z in merge_ranges(owned)]
        if self.tied_group is not None and tied:  # the embedding and its copy on two pipeline ranks
            torch.distributed.all_reduce(tied[0], group=self.tied_group)
        elif len(tied) == 2:  # both on this rank, in two stages (zbv, dualpipev): the same sum into both
            tied[0].add_(tied[1])
            tied[1].copy_(tied[0])

    def _write_back(self) -> None:
        """Nothing to write: the masters are the shards. A group still gathered from before (the stage's ends
        after an evaluation) is freed, so that the next forward gathers the updated shards."""
        reshard_all(self.pmodel)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, master, _, _ in self._masters:
            master.grad = None
        for _, p in self.pmodel.unique_parameters():
            p.grad = None
        self._grads, self._norm_views = [], []

    # -- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes held on this rank by each part of the training state. params: the fp32 shards (the master
        weights too); main_grads: their fp32 gradients; gathered_unit: the weights gathered for compute at once at the
        step's peak, in the compute dtype or float8 (fsdp.gathered_bytes: the stage's ends and two layers at pp = 1)."""
        shards = sum(m.numel() for _, m, _, _ in self._masters)
        report = {
            "params": shards * 4,
            "main_grads": shards * 4,
            "gathered_unit": gathered_bytes(self.pmodel),
            "master_weights": 0,
            "optimizer_state": self._state_bytes(),
        }
        report["total"] = sum(report.values())
        return report


def _row(p: torch.Tensor) -> int:
    return p.numel() // p.shape[0] if p.shape[0] else 1


def _is_embedding(p) -> bool:
    from ..parallel.layout import get_pieces

    return any(piece.hf_name == "model.embed_tokens.weight" for piece in get_pieces(p))
