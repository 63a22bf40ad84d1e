"""Pipeline parallelism: hf3d's stages under torch.distributed.pipelining schedules.

hf3d owns the split (hf3d.parallel.stage) and what crosses between stages: hidden states
[micro_batch, seq (/tp under SP), hidden] as the activation, position ids as a keyword argument
that the schedule splits per micro-batch and hands to every stage (each stage rebuilds rotary
cos/sin and masks from them, so packed sequences work). Under context parallelism the activations and
token ids hold this cp rank's S/cp tokens while the position ids stay the full [micro_batch, S] rows.
The schedules are PyTorch's own.

The loss of each micro-batch is its token-loss sum divided by the token count of the whole
global batch, and the schedule does not rescale gradients (scale_grads=False): summing over
micro-batches and dp ranks then gives exactly the global token mean.

Under 1f1b the last stage hands the schedule its final hidden states and the loss function runs the
fused output head (VocabParallelLMHead.fused_loss_terms): no [tokens, vocab] logits. That head makes
its weight's gradient in the forward, which is right when each micro-batch's backward follows its
forward at once, as 1f1b's last stage does; the other schedules keep several of the last stage's
micro-batches alive (afab all of them) and run the plain head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .expert import aux_stats, close_forward

SCHEDULES = {  # torch.distributed.pipelining's classes, imported when the first pipeline is built (pp > 1): a run
    # at pp = 1 never loads that package (1.0 MiB less in a tp=3 rank's load peak, as bench_load_memory.py measured it)
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("afab", "1f1b")
FUSED_HEAD_SCHEDULES = ("1f1b",)  # one micro-batch alive at a time on the last stage


class _Pipeline:
    """PipelineStages and a schedule for one micro-batch shape (rebuilt if the shape changes)."""

    def __init__(self, pmodel, mb_shape: tuple[int, int], fused_head: bool):
        from torch.distributed import pipelining

        pcfg = pmodel.pcfg
        self.mb_shape, self.fused_head = mb_shape, fused_head
        b, s = mb_shape
        s_local = s // pcfg.tp if pcfg.sequence_parallel else s
        dtype, device, cfg = pmodel.param_dtype, pmodel.device, pmodel.config
        # static stage metadata (no shape-inference pass, which would run tp collectives on fake data);
        # floating activations carry requires_grad so the schedule exchanges their gradients
        hidden = torch.empty(b, s_local, cfg.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        self.pmodel, self.stats = pmodel, aux_stats(pmodel.router_stats)
        self.num_tokens, self.z_loss = torch.ones(()), 0.0
        self.parts: list[torch.Tensor] = []  # [cross-entropy, z-loss, load balance] of each micro-batch, this step
        self.stages = []
        chain = ()
        if self.stats is not None:
            chain = (torch.empty(2, self.stats.num_experts, device="meta", requires_grad=True),)
        for st in pmodel.stages:
            inp = torch.empty(b, s, dtype=torch.long, device="meta") if st.first else hidden
            out = hidden
            if st.last and not fused_head:
                out = torch.empty(b, s, st.lm_head.num_local, dtype=dtype, device="meta", requires_grad=True)
            self.stages.append(
                pipelining.PipelineStage(
                    st,  # the stage itself: FSDP2's root under ZeRO-3, which the schedule then runs its own way
                    st.stage_index,
                    pcfg.num_stages,
                    device,
                    input_args=(inp,) if st.first else (inp, *chain),
                    output_args=(out, *chain),
                    group=pmodel.mesh.get_group("pp"),
                )
            )
        last = next((st for st in pmodel.stages if st.last), None)
        self.lm_head = last.lm_head if last is not None else None
        cls = getattr(pipelining, SCHEDULES[pcfg.pp_schedule])
        stage_arg = self.stages[0] if pcfg.pp_schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(stage_arg, n_microbatches=pcfg.num_microbatches, loss_fn=self._loss, scale_grads=False)
        self.has_first = any(st.first for st in pmodel.stages)
        self.has_last = last is not None

    def _loss(self, out, targets: torch.Tensor) -> torch.Tensor:
        """out: the last stage's hidden states (fused head) or its local logits (with the router
        statistics' chain for a MoE model's load-balancing loss)."""
        out, chain = out if self.stats is not None else (out, None)
        if self.fused_head:
            objective, ce, z = self.lm_head.fused_loss_terms(out, targets, self.num_tokens, z_loss=self.z_loss)
        else:
            objective, ce, z = self.lm_head.loss_terms(
                out.flatten(0, 1), targets.flatten(), self.num_tokens, z_loss=self.z_loss
            )
        objective, aux = close_forward(self.stats, self.pmodel.cp.rank, objective, chain)
        self.parts.append(torch.stack([ce, z, aux]))
        return objective


def run_pipeline(pmodel, input_ids, position_ids, targets, num_tokens, *, z_loss: float = 0.0) -> torch.Tensor:
    """One training step's forward + backward through the schedule; returns [cross-entropy, z-loss, load
    balance], each summed over micro-batches, the same on every pipeline rank (the schedule sees their sum)."""
    m = pmodel.pcfg.num_microbatches
    mb_shape = (input_ids.shape[0] // m, input_ids.shape[1])
    fused_head = pmodel.fused_loss and pmodel.pcfg.pp_schedule in FUSED_HEAD_SCHEDULES
    pipe = pmodel._pipeline
    if pipe is None or (pipe.mb_shape, pipe.fused_head) != (mb_shape, fused_head):
        pipe = pmodel._pipeline = _Pipeline(pmodel, mb_shape, fused_head)
    pipe.num_tokens, pipe.z_loss, pipe.parts = num_tokens, z_loss, []
    losses: list[torch.Tensor] = []
    args = (input_ids,) if pipe.has_first else ()
    target = targets if pipe.has_last else None
    # return_outputs=False: the last stage would otherwise keep every micro-batch's logits shard until
    # the next step, plus a merged copy
    # every stage takes these keywords (StageModule.forward); head=False: the last stage stops at its final norm
    kwargs = dict(position_ids=position_ids, head=not fused_head, carry=pipe.stats)
    pipe.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
    sums = torch.zeros(3, device=pmodel.device)
    for part in pipe.parts:  # in micro-batch order, as the last stage ran them
        sums += part
    pipe.parts = []
    dist.broadcast(sums, group=pmodel.mesh.get_group("pp"), group_src=pmodel.stage_owners[-1])
    return sums


def relay_forward(
    pmodel, input_ids: torch.Tensor, position_ids: torch.Tensor, *, head: bool = True, segments=None, decode=None
) -> torch.Tensor | None:
    """Run the stages one after another (one micro-batch), passing activations over pp. Returns the last
    stage's local logits [b, s, V/tp] on the rank that runs it (its normed hidden states with head=False),
    None on the others. segments: rows whose units share a context (hf3d.parallel.segments); decode: a step of
    KV-cached decoding (hf3d.generation), which runs without sequence parallelism."""
    pp_group = pmodel.mesh.get_group("pp")
    b, s = input_ids.shape
    s_local = s // pmodel.pcfg.tp if pmodel.pcfg.sequence_parallel and decode is None else s
    by_index = {st.stage_index: st for st in pmodel.stages}
    x, me = input_ids, pmodel.pp_rank
    for idx, owner in enumerate(pmodel.stage_owners):
        if owner != me:
            continue
        if idx > 0 and pmodel.stage_owners[idx - 1] != me:
            x = torch.empty(b, s_local, pmodel.config.hidden_size, dtype=pmodel.param_dtype, device=pmodel.device)
            dist.recv(x, group=pp_group, group_src=pmodel.stage_owners[idx - 1])
        x = by_index[idx](x, position_ids=position_ids, head=head, segments=segments, decode=decode)
        nxt = idx + 1
        if nxt < len(pmodel.stage_owners) and pmodel.stage_owners[nxt] != me:
            dist.send(x.contiguous(), group=pp_group, group_dst=pmodel.stage_owners[nxt])
    return x if me == pmodel.stage_owners[-1] else None
