"""ParallelModel: the stock HF model, split over the mesh, with train_step / __call__ / export."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import ParallelConfig
from .hf import DEFAULT_MAX_SHARD_BYTES, TensorSpec, write_hf_dir, write_order
from .layout import get_pieces
from .stage import StageModule
from .tensor_parallel import IGNORE_INDEX

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
        self.last_z_loss: torch.Tensor | None = None  # the z-loss term of the last train_step, global mean
        # train_step at pp=1 and under 1f1b: the lm_head matmul and the loss run chunk by chunk, with no
        # [tokens, vocab] logits (tensor_parallel._FusedHeadLoss); False runs the plain head + loss_terms
        self.fused_loss = True
        self.dropout_rng = None  # this rank's tensor-parallel dropout stream (hf3d/rng.py), set by parallelize

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
        if self._out_of_vocab(input_ids).item():
            self._raise_out_of_vocab(input_ids, None, dp_group=None)
        if self.pcfg.pp == 1:
            return self.lm_head.full_logits(self.stages[0](input_ids, position_ids))
        local_logits = self._relay_forward(input_ids, position_ids)
        last_owner = self.stage_owners[-1]
        if local_logits is not None:
            logits = self.lm_head.full_logits(local_logits).contiguous()
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, number of non-ignored targets) over this dp rank's rows, summed over dp.

        Collective over the whole mesh; every rank gets the global values (their ratio is the token-mean
        loss). One forward, no grad, no micro-batches: the batch size bounds the memory. The vocab-parallel
        cross-entropy runs on the last stage; no rank builds full-vocab logits. Pass exactly one of labels
        (HF semantics) and shift_labels (already shifted)."""
        input_ids = input_ids.to(self.device)
        targets, given, name = self._targets(input_ids, labels, shift_labels)
        position_ids = self._positions(input_ids, position_ids)
        self._check_vocab(input_ids, given, name)
        was_training = self.training
        self.eval()  # dropout off, as in stock evaluation
        try:
            if self.pcfg.pp == 1:
                local_logits = self.stages[0](input_ids, position_ids)
            else:
                local_logits = self._relay_forward(input_ids, position_ids)
        finally:
            self.train(was_training)
        sums = torch.zeros(2, device=self.device)
        if local_logits is not None:
            loss_sum = self.lm_head.token_losses(local_logits.flatten(0, 1), targets.flatten()).sum()
            sums = torch.stack([loss_sum, (targets != IGNORE_INDEX).sum().float()])
        del local_logits
        if self.pcfg.pp > 1:
            dist.broadcast(sums, group=self.mesh.get_group("pp"), group_src=self.stage_owners[-1])
        if self.dp_size > 1:
            dist.all_reduce(sums, group=self.mesh.get_group("dp"))
        return sums[0], sums[1]

    def _check_vocab(self, input_ids: torch.Tensor, labels: torch.Tensor, labels_name: str) -> None:
        """Raise on an id outside the vocabulary in any dp replica's rows (collective over dp)."""
        out_of_vocab = self._out_of_vocab(input_ids, labels)
        if self.dp_size > 1:
            dist.all_reduce(out_of_vocab, group=self.mesh.get_group("dp"))
        if out_of_vocab.item():
            dp_group = self.mesh.get_group("dp") if self.dp_size > 1 else None
            self._raise_out_of_vocab(input_ids, labels, dp_group=dp_group, labels_name=labels_name)

    def _out_of_vocab(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """1.0 when an id is outside [0, vocab_size) or a label is neither -100 nor inside it, else 0.0.
        One min/max reduction per tensor and no host sync; where the bad value sits is found only on failure."""
        v = self.config.vocab_size
        flag = torch.zeros((), device=input_ids.device)
        tensors = [input_ids] if labels is None else [input_ids, labels.masked_fill(labels == IGNORE_INDEX, 0)]
        for t in tensors:
            if t.numel():
                lo, hi = torch.aminmax(t)
                flag = torch.maximum(flag, ((lo < 0) | (hi >= v)).float())
        return flag

    def _raise_out_of_vocab(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, *, dp_group, labels_name: str = "labels"
    ) -> NoReturn:
        """Raise one ValueError naming the first bad value. With dp_group this is collective over dp: every
        dp rank reports the same value, also the ranks whose own rows are all valid."""
        v = self.config.vocab_size
        found = torch.full((5,), -1, dtype=torch.int64, device=input_ids.device)  # [dp rank, tensor, row, col, value]
        checks = [(input_ids < 0) | (input_ids >= v)]
        if labels is not None:
            checks.append(((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= v))
        for which, (tensor, bad) in enumerate(zip((input_ids, labels), checks)):
            hits = bad.nonzero()
            if len(hits):
                row, col = hits[0].tolist()
                found = torch.tensor([self.dp_rank, which, row, col, int(tensor[row, col])], device=found.device)
                break
        if dp_group is not None:
            everyone = [torch.empty_like(found) for _ in range(self.dp_size)]
            dist.all_gather(everyone, found, group=dp_group)
            found = next(f for f in everyone if f[0] >= 0)
        dp_rank, which, row, col, value = found.tolist()
        where = f" on dp rank {dp_rank}" if dp_group is not None else ""
        if which == 0:
            what, rule = f"input_ids[{row}, {col}] = {value}{where}", f"token ids must be in [0, {v})"
        else:
            what = f"{labels_name}[{row}, {col}] = {value}{where}"
            rule = f"{labels_name} must be -100 (ignored) or in [0, {v})"
        raise ValueError(
            f"{what} is outside the model's vocabulary (vocab_size={v}): {rule}; "
            "check that the tokenizer and the model match"
        )

    def _relay_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Run the stages one after another (one micro-batch), passing activations over pp. Returns the last
        stage's local logits [b, s, V/tp] on the rank that runs it, None on the others."""
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
        return x if me == self.stage_owners[-1] else None

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
        non-ignored targets over all dp ranks. z_loss > 0 adds z_loss * logsumexp(logits)^2, averaged over
        the same tokens, to what is backpropagated (PaLM's z-loss) but not to the returned value; that term's
        global mean is left in `self.last_z_loss`.
        """
        if not isinstance(z_loss, (int, float)) or not z_loss >= 0.0 or z_loss == float("inf"):
            raise ValueError(f"z_loss must be a finite number >= 0 (0 turns it off), got {z_loss!r}")
        input_ids = input_ids.to(self.device)
        targets, given, name = self._targets(input_ids, labels, shift_labels)
        position_ids = self._positions(input_ids, position_ids)
        m = self.pcfg.num_microbatches
        if input_ids.shape[0] % m:
            raise ValueError(
                f"num_microbatches={m} does not divide this dp rank's batch of {input_ids.shape[0]} rows; "
                f"use a per-rank batch that is a multiple of {m}"
            )
        num_tokens = (targets != IGNORE_INDEX).sum().to(torch.float32)
        out_of_vocab = self._out_of_vocab(input_ids, given)
        dp_group = self.mesh.get_group("dp")
        if self.dp_size > 1:
            # the bad-id flag rides on the token count's all-reduce, so a bad id in one replica's rows
            # stops every replica (the ranks of one replica hold the same rows)
            counts = torch.stack([num_tokens, out_of_vocab])
            dist.all_reduce(counts, group=dp_group)
            num_tokens, out_of_vocab = counts.unbind()
        if out_of_vocab.item():
            self._raise_out_of_vocab(
                input_ids, given, dp_group=dp_group if self.dp_size > 1 else None, labels_name=name
            )
        num_tokens = num_tokens.clamp_min(1.0)
        if self.grad_sync is not None:
            self.grad_sync.start_step(m)

        z_loss = float(z_loss)
        if self.pcfg.pp == 1:
            sums = torch.zeros(2, device=self.device)  # [cross-entropy, z-loss]
            for ids, pos, tgt in zip(input_ids.chunk(m), position_ids.chunk(m), targets.chunk(m)):
                if self.fused_loss:
                    hidden = self.stages[0](ids, pos, head=False)
                    objective, ce, z = self.lm_head.fused_loss_terms(hidden, tgt, num_tokens, z_loss=z_loss)
                    del hidden
                else:  # no name holds the logits: a logits tensor kept alive through backward would be a
                    # third [tokens, vocab] buffer at the peak (backward needs only the saved log-softmax)
                    objective, ce, z = self.lm_head.loss_terms(
                        self.stages[0](ids, pos).flatten(0, 1), tgt.flatten(), num_tokens, z_loss=z_loss
                    )
                objective.backward()
                sums += torch.stack([ce, z])
        else:
            from .pipeline import run_pipeline

            sums = run_pipeline(self, input_ids, position_ids, targets, num_tokens, z_loss=z_loss)
        if self.dp_size > 1:
            dist.all_reduce(sums, group=dp_group)
        total, self.last_z_loss = sums.unbind()
        return total

    # -- export -----------------------------------------------------------------------------------
    @torch.no_grad()
    def save_pretrained(self, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        """Collective: write an HF directory (safetensors + config.json + generation config and tokenizer
        files if known) that stock `AutoModelForCausalLM.from_pretrained` loads.

        Streams tensor by tensor: every rank walks the HF names in the writer's order; for each one, the
        ranks owning pieces of it (dp rank 0's replica) send them to rank 0, which assembles that one
        tensor, writes it and drops it. No rank ever holds more than one full tensor."""
        rank = dist.get_rank()
        mine: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {}  # name -> (dim, start, stop) -> view
        if self.dp_rank == 0:
            for _, param in self.unique_parameters():
                for p in get_pieces(param):
                    if p.owner:
                        mine.setdefault(p.hf_name, {})[(p.dim, p.hf_start, p.hf_stop)] = p.local(param).detach()
        table = [None] * dist.get_world_size()
        dist.all_gather_object(table, {name: list(ranges) for name, ranges in mine.items()})
        tied = self.config.tie_word_embeddings
        dtype = self.param_dtype
        specs = [TensorSpec(n, s, dtype) for n, s in self.hf_shapes.items() if not (tied and n == "lm_head.weight")]
        sources = export_sources(table, specs)

        error = None
        if rank != 0:
            for name in write_order(specs, max_shard_bytes):
                for src, *key in sources[name]:
                    if src == rank:
                        dist.send(mine[name][tuple(key)].contiguous(), dst=0)
        else:
            shapes = {s.name: s.shape for s in specs}
            received = set()

            def piece(name: str, dim: int, start: int, stop: int) -> torch.Size:
                shape = list(shapes[name])
                shape[dim] = stop - start
                return torch.Size(shape)

            def produce(name: str) -> torch.Tensor:
                full = torch.empty(shapes[name], dtype=dtype)
                for src, dim, start, stop in sources[name]:
                    region = full.narrow(dim, start, stop - start)
                    if src == 0:
                        region.copy_(mine[name][(dim, start, stop)])
                    else:
                        buf = torch.empty(region.shape, dtype=dtype, device=self.device)
                        dist.recv(buf, src=src)
                        region.copy_(buf)
                received.add(name)
                return full

            config = copy.deepcopy(self.config)
            config.dtype = dtype
            try:
                write_hf_dir(
                    out_dir, specs, produce, config, src_dir=self.tokenizer_dir, max_shard_bytes=max_shard_bytes
                )
            except (OSError, ValueError) as e:  # the disk, not the peers: take what they still send, then tell them
                error = e
                for name in write_order(specs, max_shard_bytes):
                    for src, dim, start, stop in sources[name] if name not in received else ():
                        if src != 0:
                            dist.recv(
                                torch.empty(piece(name, dim, start, stop), dtype=dtype, device=self.device), src=src
                            )
        # the end of the export for every rank: rank 0's failure (a full disk, an unwritable folder) is
        # raised everywhere instead of leaving the senders waiting in the next collective
        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(outcome, src=0)
        if error is not None:
            raise error
        if outcome[0] is not None:
            raise ValueError(f"rank 0 could not write the HF directory {out_dir}: {outcome[0]}")


def export_sources(table: list[dict], specs: list[TensorSpec]) -> dict[str, list[tuple[int, int, int, int]]]:
    """{hf_name: [(rank, dim, start, stop), ...]}: which rank sends which range of each exported tensor,
    from every rank's {hf_name: [(dim, start, stop)]} of owned pieces. Checks that every element is
    covered exactly once: the pieces of a tensor tile it along one dim, without gap or overlap."""
    shapes = {s.name: s.shape for s in specs}
    sources: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in shapes}
    for rank, owned in enumerate(table):
        for name, ranges in owned.items():
            assert name in shapes, f"export: a rank owns a piece of {name!r}, which is not exported"
            sources[name] += [(rank, *r) for r in ranges]
    wrong = []
    for name, ranges in sources.items():
        ranges.sort(key=lambda r: r[2])
        dims = {r[1] for r in ranges}  # empty when no rank owns the tensor
        edges = [e for r in ranges for e in r[2:]]
        tiles = len(dims) == 1 and edges[0] == 0 and edges[-1] == shapes[name][ranges[0][1]]  # one dim, 0..size
        if not (tiles and all(edges[i] == edges[i + 1] for i in range(1, len(edges) - 1, 2))):
            wrong.append(name)
    assert not wrong, f"export covered these tensors wrongly: {wrong[:5]}"
    return sources
