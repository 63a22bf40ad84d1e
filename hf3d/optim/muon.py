"""Muon at the mesh: `torch.optim.Muon` on whole HF matrices, AdamW on the rest, under tp, pp, ZeRO-1 and ep.

Muon (Jordan et al. 2024; torch.optim.Muon) orthogonalises each weight matrix's momentum by Newton-Schulz, so its
update of an element depends on the whole matrix: it cannot step hf3d's flat ZeRO fragments or a tensor-parallel
slice, and stock computes it on the unfused model's matrices (q, k and v apart, gate and up apart, each expert's
own). The hybrid every recipe uses (Moonlight, torchtitan, Megatron-Core): Muon for the hidden matrices, the ones
whose fan-in and fan-out both grow with width (the family adapter's `fan_axes`, µP's own split); AdamW for the
embedding, the head, routers, norms and biases.

How the mesh is handled:
- gradients: Muon's matrices get gradient buckets of their own, all-reduced over their reduction group (dp x cp, or
  an expert's group): every replica then holds each matrix's whole reduced gradient slice. The rest keeps the run's
  ZeRO stage (hf3d/optim/zero.py). The global norm and clipping cover both, as before.
- ownership (ZeRO-1): each HF matrix is stepped by one index of its reduction group, greedily balanced by size;
  at ZeRO-0 every index steps every matrix. The owner holds the matrix's fp32 master and Muon's momentum, whole.
- tensor parallelism: the tp ranks of the owning index all-gather their slices (broadcasts of each rank's pieces)
  and each runs Newton-Schulz on the whole matrix: the same input on every tp rank gives the same output, so no
  result needs sending back within tp, at the price of tp-fold redundant Newton-Schulz (the cheaper side on a node's
  fast links; splitting the matrices over the tp ranks would add a scatter of the results).
- after the step the owner broadcasts its matrices' slices over the reduction group, each tp rank its own pieces,
  into every replica's parameters: the bytes of ZeRO-1's parameter gather.
- pipeline stages step their own matrices; an expert's matrices live in its expert group.

µP (`parametrization: spectral_mup`): Muon's update is orthogonal (spectral norm about 1) times torch's lr
adjustment, "original" sqrt(max(1, fan_out / fan_in)), which for a hidden matrix does not change with width: the
spectral condition ‖ΔW‖ = Θ(√(fan_out / fan_in)) then holds with Muon's lr unscaled (lr scale 1), so a proxy's lr
carries. "match_rms_adamw" (0.2 · sqrt(max(fan_out, fan_in))) grows as √m, so hf3d scales Muon's lr by 1/√m there.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.layout import get_pieces
from . import precision
from . import state as optim_state
from .zero import BucketedOptimizer, reduction_groups

MUON_KEYS = ("momentum_buffer",)  # torch.optim.Muon's per-element state
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused", "capturable")


def hidden_matrix_names(pmodel) -> set[str]:
    """The HF names Muon steps by default: 2-D tensors whose fan-in and fan-out both grow with width."""
    from ..models import get_adapter

    adapter = get_adapter(pmodel.config.model_type)
    return {
        name
        for name, shape in pmodel.hf_shapes.items()
        if len(shape) == 2 and adapter.fan_axes(name, tuple(shape), pmodel.config) == (True, True)
    }


def muon_names(pmodel, patterns: list[str] | None) -> set[str]:
    """The HF names Muon steps: the hidden matrices, or the ones `patterns` (fnmatch) pick, each 2-D."""
    if patterns is None:
        return hidden_matrix_names(pmodel)
    picked = {n for n in pmodel.hf_shapes if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    for name in sorted(picked):
        shape = tuple(pmodel.hf_shapes[name])
        if len(shape) != 2:
            raise ValueError(
                f"muon_params picks {name} of shape {list(shape)}: Muon orthogonalises 2-D matrices only; leave "
                "norms, biases and other vectors to AdamW (narrow the patterns)"
            )
    if not picked:
        raise ValueError(
            f"muon_params {patterns} match no parameter of the model: use HF names such as 'model.layers.*.mlp.*' or "
            "'model.layers.*.self_attn.*'"
        )
    return picked


def _balance(names: list[str], shapes: dict, size: int) -> dict[str, int]:
    """Each name to one of `size` indices, greedily by descending size: the same on every rank."""
    load, owner = [0] * size, {}
    for name in sorted(names, key=lambda n: (-math.prod(shapes[n]), n)):
        i = min(range(size), key=lambda k: (load[k], k))
        owner[name] = i
        load[i] += math.prod(shapes[name])
    return owner


class MatrixGroup:
    """The Muon matrices of one reduction group: who steps which, and the collectives that assemble and return them.

    `pieces`: (param, piece) of every Muon piece this rank holds, in a fixed order; `whole[name]`: the fp32 master of
    each matrix this index steps (on each of its tp ranks)."""

    def __init__(self, params, group, tp_group, shapes: dict, *, shard: bool):
        self.group, self.tp_group, self.shapes = group, tp_group, shapes
        self.size = dist.get_world_size(group) if shard else 1
        self.index = dist.get_rank(group) if shard else 0
        self.pieces = [(p, pc) for p in params for pc in get_pieces(p)]
        names = sorted({pc.hf_name for _, pc in self.pieces})
        self.owner = _balance(names, shapes, self.size)
        self.mine = [n for n in names if self.owner[n] == self.index]
        mine = set(self.mine)
        # each tp rank's owned pieces of this index's matrices, in its send order
        own = [(pc.hf_name, pc.dim, pc.hf_start, pc.hf_stop) for _, pc in self._held(mine)]
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_pieces = [own] * self.tp_size
        if self.tp_size > 1:
            dist.all_gather_object(self.tp_pieces, own, group=tp_group)
        device = params[0].device
        self.whole = {n: torch.zeros(shapes[n], dtype=torch.float32, device=device) for n in self.mine}
        for w in self.whole.values():  # no autograd reaches them; a bf16 gradient keeps Muon's momentum in bf16
            w.grad_dtype = None
        self.gather(values=True, grads=False)

    @torch.no_grad()
    def gather(self, *, values: bool, grads: bool) -> None:
        """This index's whole matrices from the tp ranks' pieces: their values into the masters and/or their
        reduced gradients into the masters' .grad (each tp rank broadcasts the pieces it owns)."""
        kinds = (["value"] if values else []) + (["grad"] if grads else [])
        if grads:
            for n in self.mine:
                self.whole[n].grad = torch.zeros_like(self.whole[n])
        mine = set(self.mine)
        held = self._held(mine)
        send = [pc.local(p.detach() if k == "value" else p.main_grad).reshape(-1) for k in kinds for p, pc in held]
        flat = torch.cat(send).float() if send else torch.zeros(0, device=self._device())
        for r, pieces in enumerate(self.tp_pieces):
            if not pieces:
                continue
            sizes = [self._numel(pc) for pc in pieces] * len(kinds)
            buf = flat if r == self._tp_rank() else torch.empty(sum(sizes), device=flat.device)
            if self.tp_size > 1:
                dist.broadcast(buf, group=self.tp_group, group_src=r)
            for k, chunk in enumerate(buf.split(sizes)):
                name, dim, a, z = pieces[k % len(pieces)]
                target = self.whole[name] if kinds[k // len(pieces)] == "value" else self.whole[name].grad
                view = target.narrow(dim, a, z - a)
                view.copy_(chunk.view(view.shape))

    def _held(self, names: set[str]) -> list:
        """(param, piece) of the pieces this rank owns of `names`, in the fixed order."""
        return [(p, pc) for p, pc in self.pieces if pc.owner and pc.hf_name in names]

    def _numel(self, piece) -> int:
        name, dim, a, z = piece
        shape = list(self.shapes[name])
        shape[dim] = z - a
        return math.prod(shape)

    def _tp_rank(self) -> int:
        return 0 if self.tp_size == 1 else dist.get_rank(self.tp_group)

    def _device(self) -> torch.device:
        return self.pieces[0][0].device

    @torch.no_grad()
    def scatter(self) -> None:
        """Every index's updated matrices into every replica's parameters: each owner broadcasts, over the
        reduction group, the pieces this tp rank holds of the matrices it stepped."""
        for src in range(self.size):
            held = [(p, pc) for p, pc in self.pieces if self.owner[pc.hf_name] == src]
            if not held:
                continue
            if src == self.index:
                parts = [self.whole[pc.hf_name].narrow(pc.dim, pc.hf_start, pc.hf_stop - pc.hf_start) for _, pc in held]
                buf = torch.cat([t.reshape(-1) for t in parts]).to(held[0][0].dtype)
            else:
                size = sum(pc.local(p).numel() for p, pc in held)
                buf = torch.empty(size, dtype=held[0][0].dtype, device=self._device())
            if self.size > 1:
                dist.broadcast(buf, group=self.group, group_src=src)
            for (p, pc), chunk in zip(held, buf.split([pc.local(p).numel() for p, pc in held])):
                view = pc.local(p.data)
                view.copy_(chunk.view(view.shape))

    def free_grads(self) -> None:
        for w in self.whole.values():
            w.grad = None


class Hybrid(torch.optim.Optimizer):
    """AdamW over the fragments and Muon over the whole matrices, seen as one optimizer: one list of param groups
    (an LR scheduler drives both) and one state dict (keyed by the tensors each steps)."""

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer, matrices: list[MatrixGroup]):
        self.adamw, self.muon, self.matrices = adamw, muon, matrices
        self.defaults = {}
        self.param_groups = adamw.param_groups + muon.param_groups
        self.state = adamw.state
        muon.state = self.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    state_precision, owns_state_precision = "fp32", True

    @torch.no_grad()
    def step(self, closure=None):
        if self.state_precision == "bf16":
            precision.step_with_bf16_state(self.adamw)
        else:
            self.adamw.step()
        for mg in self.matrices:
            mg.gather(values=False, grads=True)
            if self.state_precision == "bf16":  # Muon keeps its momentum in the gradient's dtype
                for w in mg.whole.values():
                    w.grad = w.grad.bfloat16()
        self.muon.step()
        for mg in self.matrices:
            mg.free_grads()


class MuonOptimizer(BucketedOptimizer):
    """build_optimizer(pmodel, torch.optim.Muon, ...): Muon on the hidden matrices, whole; AdamW on the rest."""

    whole_keys = MUON_KEYS

    def __init__(self, pmodel, *, names: set[str], muon_kwargs: dict, adamw_kwargs: dict, **bucketed):
        self._muon_names, self._muon_kwargs, self._adamw_kwargs = names, muon_kwargs, adamw_kwargs
        self._no_decay = bucketed["exclude_from_weight_decay"]
        super().__init__(pmodel, self._build_hybrid, optimizer_kwargs={}, **bucketed)

    def _is_matrix(self, p: nn.Parameter) -> bool:
        names = {pc.hf_name for pc in get_pieces(p)}
        inside = names & self._muon_names
        if inside and inside != names:
            raise ValueError(
                f"muon_params splits {self.names[id(p)]}, which hf3d holds as one tensor ({sorted(names)}): pick all "
                "of them or none"
            )
        return bool(inside)

    def _build_buffers(self, pmodel, params, bucket_size):
        self.matrix_params = [p for p in params if self._is_matrix(p)]
        ids = {id(p) for p in self.matrix_params}
        rest = [p for p in params if id(p) not in ids]
        buffers = self._buffers_for(pmodel, rest, bucket_size, self.zero_stage) if rest else []
        base = buffers[-1].end if buffers else 0
        return buffers + self._buffers_for(pmodel, self.matrix_params, bucket_size, 0, base)

    def _build_master(self) -> None:
        super()._build_master()
        ids = {id(p) for p in self.matrix_params}
        kept = [(m, g) for m, g in zip(self._masters, self._grads) if id(m[0]) not in ids]
        self._masters, self._grads = [m for m, _ in kept], [g for _, g in kept]

    def _build_hybrid(self, groups: list[dict]) -> Hybrid:
        adamw = torch.optim.AdamW(groups, **self._adamw_kwargs)
        pmodel = self.pmodel
        tp_group = pmodel.mesh.get_group("tp") if pmodel.pcfg.tp > 1 else None
        self.matrices = [
            MatrixGroup(members, group, tp_group, pmodel.hf_shapes, shard=self.zero_stage >= 1)
            for group, members, _ in reduction_groups(pmodel, self.matrix_params)
            if members
        ]
        muon = torch.optim.Muon(self._muon_groups(), **self._muon_kwargs)
        return Hybrid(adamw, muon, self.matrices)

    def _muon_groups(self) -> list[dict]:
        """One group (two with a no-decay rule), the same on every rank, over this rank's whole masters."""
        rule = self._no_decay
        if rule is True:
            rule = None  # the Trainer's rule leaves no hidden matrix undecayed
        # a matrix is named as the fragments are (the runtime name of the parameter holding it: qkv_proj, ...)
        held = {pc.hf_name: p for mg in self.matrices for p, pc in mg.pieces}
        whole = [(self.names[id(held[n])], w) for mg in self.matrices for n, w in mg.whole.items()]
        par = self.pmodel.parametrization
        groups = []
        for no_decay in (False, True) if rule else (False,):
            group = {"params": [w for n, w in whole if bool(rule and rule(n, w)) == no_decay]}
            if no_decay:
                group["weight_decay"] = 0.0
            if par.rules:
                group["lr_scale"] = muon_lr_scale(par.multiplier, self._muon_kwargs.get("adjust_lr_fn"))
            groups.append(group)
        return groups

    def _stepped_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return super()._stepped_grads() + [(p, p.main_grad) for p in self.matrix_params]

    # -- after the step, and the state -----------------------------------------------------------
    def _write_back(self) -> None:
        super()._write_back()
        for mg in self.matrices:
            mg.scatter()

    def after_load(self) -> None:
        """After a checkpoint load: with fp32 parameters the checkpoint holds no masters (the parameters are theirs),
        so the whole masters are gathered again from the parameters it wrote."""
        if self._aliased:
            for mg in self.matrices:
                mg.gather(values=True, grads=False)

    def whole_boxes(self, keys: list[str], *, create: bool, master: bool, my_shard: bool):
        """(key, hf_name, offsets, sizes, view) of the whole matrices this rank steps: one tp rank writes them."""
        if my_shard and self.pmodel.pcfg.tp > 1 and dist.get_rank(self.pmodel.mesh.get_group("tp")) != 0:
            return
        for mg in self.matrices:
            for name, w in mg.whole.items():
                st = self.optimizer.state[w] if create and keys else self.optimizer.state.get(w, {})
                sources = {optim_state.MASTER_KEY: w} if master else {}
                for k in keys:
                    if create or k in st:
                        sources[k] = optim_state.state_source(self, st, k, w, create=create)
                for key, t in sources.items():
                    yield key, name, [0] * t.dim(), list(t.shape), t

    def memory_report(self) -> dict[str, int]:
        report = super().memory_report()
        whole = sum(w.numel() * 4 for mg in self.matrices for w in mg.whole.values())
        report["master_weights"] += whole
        report["total"] += whole
        return report


def muon_lr_scale(multiplier: float, adjust_lr_fn: str | None) -> float:
    """µP's lr scale of Muon's hidden matrices (module docstring): 1 under torch's "original" adjustment,
    1/√m under "match_rms_adamw"."""
    return multiplier**-0.5 if adjust_lr_fn == "match_rms_adamw" else 1.0


def build_muon(pmodel, *, zero_stage: int, optimizer_kwargs: dict, **bucketed) -> MuonOptimizer:
    """The hybrid for `build_optimizer(pmodel, torch.optim.Muon, ...)`: `optimizer_kwargs` go to Muon, but `adamw`
    (a dict: lr, betas, eps, weight_decay; lr and weight_decay default to Muon's) and `muon_params` (fnmatch patterns
    of HF names; default the hidden matrices)."""
    kwargs = dict(optimizer_kwargs)
    adamw = dict(kwargs.pop("adamw", None) or {})
    patterns = kwargs.pop("muon_params", None)
    unknown = sorted(set(adamw) - set(ADAMW_KEYS))
    if unknown:
        raise ValueError(f"adamw= has keys AdamW does not take: {unknown}; use {', '.join(ADAMW_KEYS[:4])}")
    takes = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
    strange = sorted(set(kwargs) - set(takes))
    if strange:
        raise ValueError(
            f"torch.optim.Muon does not take {', '.join(strange)} (it takes {', '.join(takes)}); AdamW's settings for "
            "the other parameters go in adamw={...}"
        )
    if not 1 <= kwargs.get("ns_steps", 5) < 100:
        raise ValueError(f"ns_steps must be from 1 to 99 (torch's Newton-Schulz bound), got {kwargs['ns_steps']!r}")
    try:
        torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"torch.optim.Muon rejected {sorted(kwargs)}: {e}") from None
    if zero_stage >= 2 or pmodel.pcfg.shard_size < pmodel.pcfg.dp:
        raise ValueError(
            f"Muon runs at zero_stage 0 or 1 without dp_shard (got zero_stage={zero_stage}"
            + (f", dp_shard={pmodel.pcfg.dp_shard}" if pmodel.pcfg.shard_size < pmodel.pcfg.dp else "")
            + "): it steps whole matrices, which ZeRO-2/3 and HSDP cut; use zero_stage 0 or 1 and leave dp_shard unset"
        )
    for key in ("lr", "weight_decay"):
        if key in kwargs:
            adamw.setdefault(key, kwargs[key])
    if not {"fused", "foreach"} & adamw.keys():
        adamw["fused"] = pmodel.device.type in ("cpu", "cuda")
    names = muon_names(pmodel, patterns)
    return MuonOptimizer(pmodel, names=names, muon_kwargs=kwargs, adamw_kwargs=adamw, zero_stage=zero_stage, **bucketed)


__all__ = ["MuonOptimizer", "build_muon", "hidden_matrix_names", "muon_lr_scale"]
