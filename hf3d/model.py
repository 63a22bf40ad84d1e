"""ParallelModel: the stock HF model, split over the mesh, with train_step / __call__ / export."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.modeling_outputs import CausalLMOutputWithPast

from .hf.save import DEFAULT_MAX_SHARD_BYTES
from .optim.parametrization import Parametrization
from .parallel.config import ParallelConfig, check_cp_seq_len
from .parallel.context import CPContext
from .parallel.expert import is_expert
from .parallel.fsdp import reshard_all, restore_layout_attributes
from .parallel.mesh import data_parallel_group
from .parallel.microbatches import train_step
from .parallel.pipeline import relay_forward
from .parallel.stage import StageModule
from .parallel.tensor import IGNORE_INDEX
from .parallel.vocab import check_vocab, raise_out_of_vocab, vocab_flag

# HF call arguments that change nothing here (no KV cache while training; outputs are always a dataclass)
IGNORED_KWARGS = {"use_cache", "return_dict", "num_items_in_batch", "output_attentions", "output_hidden_states"}


class ParallelModel(nn.Module):
    """What `hf3d.parallelize` returns. `hf_model` is the stock model class, pruned to this rank's
    layers and with tensor-parallel submodules under the stock names."""

    def __init__(
        self,
        hf_model: nn.Module,
        stages: list[StageModule],
        *,
        mesh: DeviceMesh,
        pcfg: ParallelConfig,
        hf_shapes: dict[str, tuple[int, ...]],
        tokenizer_dir: Path | None,
        stage_owners: list[int],
        layer_split: list[list[int]],
        cp: CPContext | None = None,
    ):
        super().__init__()
        self.hf_model = hf_model
        self.stages = stages  # a plain list: the modules are registered once, under hf_model
        self.mesh, self.pcfg = mesh, pcfg
        self.config = hf_model.config
        self.hf_shapes, self.tokenizer_dir = hf_shapes, tokenizer_dir
        self.stage_owners, self.layer_split = stage_owners, layer_split
        # context parallel: this rank's place on the cp axis; every cp rank gets the full rows and keeps its
        # 2 of 2*cp sequence chunks (hf3d.parallel.context)
        self.cp = cp if cp is not None else CPContext(None, 0, 1)
        self.grad_sync = None  # set by build_optimizer: receives train_step's start-of-step signal
        self._pipeline = None
        self.last_z_loss: torch.Tensor | None = None  # the z-loss term of the last train_step, global mean
        # a MoE model with output_router_logits: stock's load-balancing loss of the last train_step, the mean
        # over its forwards (dp ranks x micro-batches); None for other models
        self.last_aux_loss: torch.Tensor | None = None
        # train_step at pp=1 and under 1f1b: the lm_head matmul and the loss run chunk by chunk, with no
        # [tokens, vocab] logits (tensor_parallel._FusedHeadLoss); False runs the plain head + loss_terms
        self.fused_loss = True
        # True (hf3d train): an id outside the vocabulary is reported by the next opt.step(), whose one host
        # sync reads the flag with the grad norm, before any weight changes; False: train_step reads it at
        # once (a sync before the forward). Either way the step raises the same ValueError.
        self.deferred_checks = False
        self.router_stats = None  # the MoE router statistics of the load-balancing loss, set by parallelize
        self.parametrization = Parametrization()  # µP's rules when pcfg asks for them, set by parallelize
        self.dropout_rng = None  # this rank's tensor-parallel dropout stream (hf3d/parallel/rng.py), set by parallelize
        self.compute_dtype: torch.dtype | None = None  # the dtype layers compute in, set by parallelize
        # ZeRO-3: this rank's FSDP2 groups, each a list of modules (hf3d/parallel/fsdp.py); empty otherwise
        self.fsdp_modules: list[list[nn.Module]] = []
        self.fsdp_layout: dict = {}  # ZeRO-3: hf3d's parameter attributes by (module, name), put back when lost
        self.fp8_gathered: list[str] = []  # ZeRO-3: the linears whose weights FSDP2 gathers in float8

    # -- mesh coordinates -------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def lockstep(self) -> bool:
        """Whether a forward is collective over the dp replicas, so that they must all run as many forwards: under
        expert parallelism (tokens cross the expert group) and ZeRO-3 (each layer is gathered over dp)."""
        return self.pcfg.ep > 1 or bool(self.fsdp_modules)

    def exports(self, param: nn.Parameter) -> bool:
        """Whether this rank writes `param` in checkpoints without an optimizer and in exports: the first of
        its copies over dp x cp (for an expert, over the ranks holding the same experts)."""
        if self.cp_rank:
            return False
        return self.dp_rank < self.pcfg.ep if is_expert(param) else self.dp_rank == 0

    def expert_load(self) -> torch.Tensor | None:
        """Collective: the last train_step's top-k picks per (MoE layer, expert) over the whole step, the same
        on every rank; None for a dense model."""
        stats = self.router_stats  # without sequence parallelism every tp rank routed the same tokens
        return None if stats is None else stats.step_load(1 if self.pcfg.sequence_parallel else self.pcfg.tp)

    def _replica_sum(self, sums: torch.Tensor) -> None:
        """All-reduce per-rank partial sums over dp x cp (each cp rank summed its own tokens only)."""
        if self.dp_size * self.cp.size > 1:
            dist.all_reduce(sums, group=data_parallel_group(self.mesh))

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def lm_head(self):
        return self.hf_model.lm_head

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the layers compute in and exports hold (under ZeRO-3 the fp32 shards are cast to it)."""
        return self.compute_dtype or next(self.hf_model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def unique_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their runtime names, each shared Parameter once: under ZeRO-3 FSDP2's
        shards (a group left gathered, as the stage's ends after an evaluation's forward, is freed first)."""
        if self.fsdp_modules:
            reshard_all(self)
            restore_layout_attributes(self.hf_model, self.fsdp_layout)
        return list(self.hf_model.named_parameters())

    # -- forward ----------------------------------------------------------------------------------
    def _positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        b, s = input_ids.shape
        pcfg = self.pcfg
        check_cp_seq_len(s, cp=pcfg.cp, tp=pcfg.tp, sequence_parallel=pcfg.sequence_parallel)
        if self.pcfg.sequence_parallel and s % self.pcfg.tp:
            raise ValueError(f"sequence_parallel needs the sequence length ({s}) to be a multiple of tp={self.pcfg.tp}")
        if position_ids is None:
            return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        return position_ids.to(input_ids.device)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """HF-style call on this dp replica's rows.

        In train mode with labels (or shift_labels) the whole training step runs here (train_step: forward
        and backward over every micro-batch, gradients left for `opt.step()`), and `.loss` is the global-batch
        loss as a leaf tensor that requires grad, so `loss.backward()` / `accelerator.backward(loss)` are
        harmless; `.logits` is None. Otherwise `.logits` holds the full-vocab logits on every rank, and
        `.loss` (with labels or shift_labels) the mean loss over these rows' non-ignored tokens, as stock
        computes it. `shift_labels` are targets already shifted (HF's name): `shift_labels[:, j]` is the
        target of position j; pass it or labels, not both.
        """
        if input_ids is None:
            raise ValueError("hf3d models take input_ids (inputs_embeds is not supported)")
        unknown = set(kwargs) - IGNORED_KWARGS
        if unknown:
            raise ValueError(f"hf3d models do not take {', '.join(sorted(unknown))}")
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ValueError(
                "attention_mask with padding is not supported yet: pack rows to full length (hf3d train does) and "
                "pass attention_mask=None or all ones; use position_ids that restart per document for packed data"
            )
        has_targets = labels is not None or shift_labels is not None
        if has_targets and self.training:
            loss = self.train_step(input_ids, labels, position_ids=position_ids, shift_labels=shift_labels)
            return CausalLMOutputWithPast(loss=loss.detach().requires_grad_())
        logits = self.logits(input_ids, position_ids)
        loss = None
        if has_targets:
            targets, _, _ = self._targets(input_ids.to(logits.device), labels, shift_labels)
            loss = nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _targets(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(targets [b, s]: the target of each position, -100 ignored; the tensor the caller passed; its name)."""
        if (labels is None) == (shift_labels is None):
            raise ValueError(
                "pass exactly one of labels (HF semantics, shifted inside) and shift_labels (already shifted: "
                "shift_labels[:, j] is the target of position j), got " + ("both" if labels is not None else "neither")
            )
        name, given = ("labels", labels) if labels is not None else ("shift_labels", shift_labels)
        given = given.to(input_ids.device)
        if given.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(given.shape)} must match input_ids {tuple(input_ids.shape)}")
        if shift_labels is not None:
            return given, given, name
        targets = torch.cat([given[:, 1:], given.new_full((given.shape[0], 1), IGNORE_INDEX)], dim=1)
        return targets, given, name

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocab logits [b, s, vocab] on every rank (for evaluation and tests)."""
        input_ids = input_ids.to(self.device)
        position_ids = self._positions(input_ids, position_ids)
        # No dp collective here: the ranks of one replica hold the same rows, so they all raise, and
        # a forward never waits on another replica (one replica may evaluate alone).
        if vocab_flag(self, input_ids).item():
            raise_out_of_vocab(self, input_ids, None, dp_group=None)
        local_ids = self.cp.split(input_ids)  # under cp the stages take this rank's tokens and all positions
        if self.pcfg.pp == 1:
            return self.cp.gather(self.lm_head.full_logits(self.stages[0](local_ids, position_ids=position_ids)))
        local_logits = relay_forward(self, local_ids, position_ids)
        last_owner = self.stage_owners[-1]
        if local_logits is not None:
            logits = self.cp.gather(self.lm_head.full_logits(local_logits)).contiguous()
        else:
            b, s = input_ids.shape
            logits = torch.empty(b, s, self.config.vocab_size, dtype=self.param_dtype, device=self.device)
        dist.broadcast(logits, group=self.mesh.get_group("pp"), group_src=last_owner)
        return logits

    @torch.no_grad()
    def eval_loss(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        num_groups: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, number of non-ignored targets) over this dp rank's rows, summed over dp
        (and over cp, whose ranks each count their own tokens). With groups (each row's group, LongTensor [rows]
        in [0, num_groups): e.g. its data source), both are [num_groups] tensors, from the same one forward.

        Collective over the whole mesh; every rank gets the global values (their ratio is the token-mean
        loss). One forward, no grad, no micro-batches: the batch size bounds the memory. The vocab-parallel
        cross-entropy runs on the last stage; no rank builds full-vocab logits. Pass exactly one of labels
        (HF semantics) and shift_labels (already shifted)."""
        input_ids = input_ids.to(self.device)
        targets, given, name = self._targets(input_ids, labels, shift_labels)
        return _eval_loss(self, input_ids, targets, given, name, position_ids, groups, num_groups)

    # -- training ---------------------------------------------------------------------------------
    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        z_loss: float = 0.0,
    ) -> torch.Tensor:
        """Forward + backward over this dp rank's rows; gradients accumulate for `opt.step()`.

        Targets: exactly one of labels (HF semantics: shifted inside, -100 ignored) and shift_labels
        (already shifted: `shift_labels[:, j]` is the target of position j, -100 ignored; packed windows
        of seq_len + 1 tokens pass `input_ids=w[:, :-1], shift_labels=w[:, 1:]`).

        Returns the cross-entropy as the exact token mean over the global batch: sum of token losses /
        non-ignored targets over all dp ranks. Under cp every cp rank passes the same full rows; each runs
        its own tokens and the parts are summed over cp. z_loss > 0 adds z_loss * logsumexp(logits)^2, averaged over
        the same tokens, to what is backpropagated (PaLM's z-loss) but not to the returned value; that term's
        global mean is left in `self.last_z_loss`.

        A MoE model whose config has `output_router_logits: true` also backpropagates router_aux_loss_coef
        times stock's load-balancing loss, averaged over the step's forwards (every dp rank x micro-batch,
        micro-batch j being the j-th contiguous chunk of the rank's rows); that mean is left in
        `self.last_aux_loss` (the same on every rank) and the returned value stays the cross-entropy.
        """
        return train_step(self, input_ids, labels, position_ids, shift_labels=shift_labels, z_loss=z_loss)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options):
        """KV-cached decoding at this mesh as transformers' `generate` decodes, on this dp replica's left-padded
        prompts, with stock's option names (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, stop_strings + tokenizer, output_logits, return_dict_in_generate) and `seed`; collective
        over the replica (hf3d/generation/decode.py)."""
        from .generation.decode import generate

        return generate(self, input_ids, attention_mask, **options)

    # -- export -----------------------------------------------------------------------------------
    def save_pretrained(
        self,
        out_dir: str | os.PathLike,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        extra_files: dict[str, bytes] | None = None,
    ) -> None:
        """Collective: write an HF directory (safetensors + config.json + generation config and tokenizer
        files if known, + `extra_files` {name: bytes} from rank 0) that stock
        `AutoModelForCausalLM.from_pretrained` loads (hf3d/hf/export.py). The folder appears complete or not at all.
        An existing out_dir is replaced only when hf3d made it and it holds nothing but an HF export's files; any
        other is refused on every rank."""
        from .hf.export import save_hf

        save_hf(self, out_dir, max_shard_bytes=max_shard_bytes, extra_files=extra_files)


@torch.no_grad()
def _eval_loss(pmodel, input_ids, targets, given, name, position_ids, groups, num_groups):
    """`ParallelModel.eval_loss` (see there), once the targets are known."""
    position_ids = pmodel._positions(input_ids, position_ids)
    check_vocab(pmodel, input_ids, given, name)
    was_training = pmodel.training
    pmodel.eval()  # dropout off, as in stock evaluation
    input_ids, targets = pmodel.cp.split(input_ids), pmodel.cp.split(targets)
    try:
        if pmodel.pcfg.pp == 1:
            local_logits = pmodel.stages[0](input_ids, position_ids=position_ids)
        else:
            local_logits = relay_forward(pmodel, input_ids, position_ids)
    finally:
        pmodel.train(was_training)
    row_groups = torch.zeros(len(targets), dtype=torch.long) if groups is None else groups
    sums = torch.zeros(2, num_groups, device=pmodel.device)
    if local_logits is not None:
        losses = pmodel.lm_head.token_losses(local_logits.flatten(0, 1), targets.flatten()).view_as(targets)
        sums = _group_sums(losses, targets != IGNORE_INDEX, row_groups.to(pmodel.device), num_groups)
    del local_logits
    if pmodel.pcfg.pp > 1:
        dist.broadcast(sums, group=pmodel.mesh.get_group("pp"), group_src=pmodel.stage_owners[-1])
    pmodel._replica_sum(sums)  # every cp rank counted its own targets
    return (sums[0], sums[1]) if groups is not None else (sums[0, 0], sums[1, 0])


def _group_sums(losses: torch.Tensor, counted: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[2, num_groups]: each group's loss sum and number of counted targets, from the per-token losses and
    target mask [rows, tokens] and each row's group [rows]."""
    per_row = torch.stack([losses.sum(1), counted.sum(1).float()])  # [2, rows]
    return torch.zeros(2, num_groups, device=losses.device).index_add_(1, groups, per_row)
