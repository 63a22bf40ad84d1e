"""ParallelModel: the stock HF model, split over the mesh, with train_step / __call__ / export."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelConfig
from .hf import write_hf_dir
from .layout import get_pieces
from .stage import StageModule

IGNORE_INDEX = -100


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
    ):
        super().__init__()
        self.hf_model = hf_model
        self.stages = stages  # a plain list: the modules are registered once, under hf_model
        self.mesh, self.pcfg = mesh, pcfg
        self.config = hf_model.config
        self.hf_shapes, self.tokenizer_dir = hf_shapes, tokenizer_dir
        self.stage_owners, self.layer_split = stage_owners, layer_split
        self.grad_sync = None  # set by build_optimizer: receives train_step's start-of-step signal
        self._pipeline = None

    # -- mesh coordinates -------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

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
        return next(self.hf_model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def unique_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their runtime names, each shared Parameter once."""
        return list(self.hf_model.named_parameters())

    # -- forward ----------------------------------------------------------------------------------
    def _positions(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        b, s = input_ids.shape
        if self.pcfg.sequence_parallel and s % self.pcfg.tp:
            raise ValueError(f"sequence_parallel needs the sequence length ({s}) to be a multiple of tp={self.pcfg.tp}")
        if position_ids is None:
            return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        return position_ids.to(input_ids.device)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocab logits [b, s, vocab] on every rank (for evaluation and tests)."""
        input_ids = input_ids.to(self.device)
        position_ids = self._positions(input_ids, position_ids)
        if self.pcfg.pp == 1:
            return self.lm_head.full_logits(self.stages[0](input_ids, position_ids))
        return self._relay_forward(input_ids, position_ids)

    def _relay_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Run the stages one after another (one micro-batch), passing activations over pp."""
        pp_group = self.mesh.get_group("pp")
        b, s = input_ids.shape
        s_local = s // self.pcfg.tp if self.pcfg.sequence_parallel else s
        by_index = {st.stage_index: st for st in self.stages}
        x, me = input_ids, self.pp_rank
        for idx, owner in enumerate(self.stage_owners):
            if owner != me:
                continue
            if idx > 0 and self.stage_owners[idx - 1] != me:
                x = torch.empty(b, s_local, self.config.hidden_size, dtype=self.param_dtype, device=self.device)
                dist.recv(x, group=pp_group, group_src=self.stage_owners[idx - 1])
            x = by_index[idx](x, position_ids)
            nxt = idx + 1
            if nxt < len(self.stage_owners) and self.stage_owners[nxt] != me:
                dist.send(x.contiguous(), group=pp_group, group_dst=self.stage_owners[nxt])
        last_owner = self.stage_owners[-1]
        if me == last_owner:
            logits = self.lm_head.full_logits(x).contiguous()
        else:
            logits = torch.empty(b, s, self.config.vocab_size, dtype=self.param_dtype, device=self.device)
        dist.broadcast(logits, group=pp_group, group_src=last_owner)
        return logits

    # -- training ---------------------------------------------------------------------------------
    def train_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward + backward over this dp rank's rows; gradients accumulate for `opt.step()`.

        Labels follow HF (shifted inside, -100 ignored). The loss is the exact token mean over the
        global batch: sum of token losses / non-ignored label tokens over all dp ranks.
        """
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
        position_ids = self._positions(input_ids, position_ids)
        m = self.pcfg.num_microbatches
        if input_ids.shape[0] % m:
            raise ValueError(
                f"num_microbatches={m} does not divide this dp rank's batch of {input_ids.shape[0]} rows; "
                f"use a per-rank batch that is a multiple of {m}"
            )
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        num_tokens = (targets != IGNORE_INDEX).sum().to(torch.float32)
        dp_group = self.mesh.get_group("dp")
        if self.dp_size > 1:
            dist.all_reduce(num_tokens, group=dp_group)
        num_tokens = num_tokens.clamp_min(1.0)
        if self.grad_sync is not None:
            self.grad_sync.start_step(m)

        if self.pcfg.pp == 1:
            total = torch.zeros((), device=self.device)
            for ids, pos, tgt in zip(input_ids.chunk(m), position_ids.chunk(m), targets.chunk(m)):
                local_logits = self.stages[0](ids, pos)
                loss = self.lm_head.token_losses(local_logits.flatten(0, 1), tgt.flatten()).sum() / num_tokens
                loss.backward()
                total += loss.detach()
        else:
            from .pipeline import run_pipeline

            total = run_pipeline(self, input_ids, position_ids, targets, num_tokens)
        if self.dp_size > 1:
            dist.all_reduce(total, group=dp_group)
        return total

    # -- export -----------------------------------------------------------------------------------
    @torch.no_grad()
    def hf_state_pieces(self) -> list[tuple[str, int, int, int, torch.Tensor]]:
        """(hf_name, dim, hf_start, hf_stop, tensor) for every piece this rank owns."""
        out = []
        for _, param in self.unique_parameters():
            for p in get_pieces(param):
                if p.owner:
                    out.append((p.hf_name, p.dim, p.hf_start, p.hf_stop, p.local(param).detach().cpu().clone()))
        return out

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Collective: write an HF directory (safetensors + config.json + tokenizer files if known)
        that stock `AutoModelForCausalLM.from_pretrained` loads. Rank 0 writes."""
        mine = self.hf_state_pieces() if self.dp_rank == 0 else []
        world = dist.get_world_size()
        gathered = [None] * world if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() == 0:
            tensors = assemble_hf_tensors([p for part in gathered for p in part], self.hf_shapes, self.config)
            config = copy.deepcopy(self.config)
            config.dtype = self.param_dtype
            write_hf_dir(Path(out_dir), tensors, config, tokenizer_dir=self.tokenizer_dir)
        dist.barrier()


def assemble_hf_tensors(pieces, hf_shapes: dict[str, tuple[int, ...]], config) -> dict[str, torch.Tensor]:
    """Full HF tensors from owned pieces; checks every element is covered exactly once."""
    names = [n for n in hf_shapes if not (config.tie_word_embeddings and n == "lm_head.weight")]
    dtype = pieces[0][4].dtype
    tensors = {n: torch.empty(hf_shapes[n], dtype=dtype) for n in names}
    filled = dict.fromkeys(names, 0)
    for name, dim, start, stop, t in pieces:
        tensors[name].narrow(dim, start, stop - start).copy_(t)
        filled[name] += t.numel()
    missing = [n for n in names if filled[n] != tensors[n].numel()]
    assert not missing, f"export covered these tensors wrongly: {missing[:5]}"
    return tensors
