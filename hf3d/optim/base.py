"""What every hf3d optimizer shares, whatever holds the gradients: the step over fp32 fragments.

hf3d's optimizers wrap a torch optimizer class around flat fp32 fragments of the runtime parameters: a
bucket's ZeRO shard (hf3d/optim/zero.py, ZeRO-0/1/2 over hf3d's own gradient buffers) or FSDP2's dim-0 shard
of a parameter (hf3d/optim/sharded.py, ZeRO-3). A subclass lays the fragments out and owns the gradient path;
this base owns the step: the global grad norm (each element counted once), the step's one host sync (the
norm, the scalars `read_with_step` queued and the flags of deferred checks), the skip on a non-finite norm,
clipping, waiting for a checkpoint still reading the weights, the wrapped optimizer's step and the state
dict by HF names and global offsets (hf3d/optim/state.py).

A fragment is `(param, master, lo, hi)` in `_masters`: `master` holds the elements [lo, hi) of `param`'s
flat range [`_flat_range[id(param)]`) in the subclass's flat coordinate, and its gradient is `_grads[i]`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.layout import get_pieces
from . import precision
from . import state as optim_state


class ParallelOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose `param_groups` and `state` are the wrapped optimizer's own (over this
    rank's fp32 master fragments), so LR schedulers and accelerate drive the real step. What `build_optimizer`
    returns: hf3d/optim/zero.py's BucketedOptimizer (ZeRO-0/1/2), its Muon hybrid (hf3d/optim/muon.py) or
    hf3d/optim/sharded.py's ShardedOptimizer (ZeRO-3)."""

    zero_stage: int
    state_precision: str = "fp32"  # of the per-element state: "fp32", "bf16" or "8bit" (hf3d/optim/precision.py)

    def _wrap(self, pmodel, optimizer_cls, optimizer_kwargs: dict, grouped: list, *, with_no_decay: bool) -> None:
        """Build the wrapped optimizer over the masters `grouped` [(master, lr scale, no decay)], and the state
        the step shares."""
        self._param_groups = _param_groups(grouped, pmodel.parametrization, with_no_decay=with_no_decay)
        try:
            self.optimizer = optimizer_cls(self._param_groups, **optimizer_kwargs)
        except TypeError as e:
            raise TypeError(f"{optimizer_cls.__name__} rejected the optimizer arguments {optimizer_kwargs}: {e}") from e
        for group in (g for g in self.optimizer.param_groups if "lr_scale" in g):  # µP: lr times the group's scale
            group["lr"] = group["lr"] * group["lr_scale"]
        self._step_started = False
        self.last_step_skipped = False
        self.last_grad_norm: torch.Tensor | None = None
        # the one host read of a step: the grad norm, the scalars handed to read_with_step and the flags
        # of checks deferred by train_step, read together in step() (last_values: the floats)
        self.last_values: dict[str, float] = {}
        self._riders: dict[str, torch.Tensor] = {}
        self._deferred: list[tuple[torch.Tensor, Callable[[], None]]] = []
        self._being_read: list[Future] = []  # the parameters and state are still being read (a checkpoint)
        # torch.optim.Optimizer's bookkeeping (hooks, step patching), over the very same group dicts
        torch.optim.Optimizer.__init__(self, self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        pmodel.grad_sync = self

    def _grouped(self, exclude_from_weight_decay) -> tuple[list, bool]:
        """[(master, lr scale, no decay)] of `_masters`, and whether a no-decay rule applies."""
        rule = exclude_from_weight_decay
        if rule is True:
            stock = no_decay_names(self.pmodel.hf_model)
            rule = lambda name, _p: name in stock  # noqa: E731
        par = self.pmodel.parametrization
        grouped = [
            (master, _lr_scale(p, par), bool(rule and rule(self.names[id(p)], p))) for p, master, _, _ in self._masters
        ]
        return grouped, bool(rule)

    # -- the step's inputs -------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        if self._step_started:
            raise RuntimeError(
                "train_step was called twice without opt.step(); call opt.step() and "
                "opt.zero_grad() after each train_step"
            )
        self._step_started = True

    def read_with_step(self, **scalars: torch.Tensor) -> None:
        """Scalar tensors (the loss, a stop flag, ...) to read on the host in the next step()'s one sync,
        together with the grad norm; their floats are in `last_values` after it."""
        self._riders.update(scalars)

    def defer_check(self, flag: torch.Tensor, fail: Callable[[], None]) -> None:
        """A check of this step's input found on the device: the next step() reads `flag` in its one
        sync and, when it is nonzero, calls `fail` (which raises) before any weight changes."""
        self._deferred.append((flag, fail))

    def _read_values(self, norm: torch.Tensor) -> dict[str, float]:
        """The step's one host sync: the norm, the riders and the deferred flags in one small tensor. A
        raised check leaves the weights and the optimizer state untouched and the gradients zeroed."""
        named = {"grad_norm": norm, **self._riders}
        checks, self._riders, self._deferred = self._deferred, {}, []
        scalars = [t.detach().float().reshape(()).to(norm.device) for t in named.values()]
        host = torch.stack(scalars + [flag.float().reshape(()) for flag, _ in checks]).tolist()
        self.last_values = dict(zip(named, host))
        for (_, fail), bad in zip(checks, host[len(named) :]):
            if bad:
                self._step_started = False
                self.zero_grad()
                fail()
        return self.last_values

    def finish_grad_sync(self) -> None:
        """Run the gradient reductions still pending and wait for them."""

    def microbatch_done(self) -> None:
        """A micro-batch's backward has ended (train_step without pipelining calls it)."""

    # -- step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over the whole mesh, every element counted once."""
        sq = torch.zeros((), device=self.device)
        for g in self._norm_views:
            sq += g.dot(g)
        dist.all_reduce(sq)
        return sq.sqrt()

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor:
        """Reduce gradients, clip to max_grad_norm, step the shard, sync params. Returns the
        pre-clip global grad norm (also kept as last_grad_norm); a non-finite norm skips the update
        (step_was_skipped). One host sync: the norm, read with whatever `read_with_step` and
        `defer_check` queued. `closure` is not supported: hf3d computes the loss in train_step."""
        if closure is not None:
            raise ValueError("ParallelOptimizer.step takes no closure: run pmodel.train_step or pmodel(**batch) first")
        self.finish_grad_sync()
        norm = self.grad_norm()
        self.last_grad_norm = norm
        value = self._read_values(norm)["grad_norm"]
        self.last_step_skipped = not math.isfinite(value)
        if self.last_step_skipped:
            warnings.warn(f"grad norm is {value}: optimizer step skipped", stacklevel=2)
            self._step_started = False
            return norm
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            self._scale_grads((self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        for (_p, master, _lo, _hi), grad in zip(self._masters, self._grads):
            master.grad = grad
        wait(self._being_read)  # an asynchronous checkpoint's write or copy (its failure is the save's)
        self._being_read.clear()
        if self.state_precision == "bf16" and not getattr(self.optimizer, "owns_state_precision", False):
            precision.step_with_bf16_state(self.optimizer)
        else:
            self.optimizer.step()
        self._write_back()
        self._step_started = False
        return norm

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self._grads:
            g.mul_(coef)

    def _write_back(self) -> None:
        """The updated masters into the parameters every rank computes with."""

    def wait_before_update(self, reading: Future) -> None:
        """Make the next update of the parameters and the optimizer state wait until `reading` is done: they
        are being read in the background (an asynchronous checkpoint's write, or its staging copy)."""
        self._being_read.append(reading)

    def nonfinite_parameters(self) -> list[str]:
        """Collective: the parameters whose reduced gradient of this step holds an inf or NaN, on any
        rank, in model order (runtime names: fused projections are qkv_proj / gate_up_proj). Call it
        after a skipped step, before zero_grad, to say where a non-finite gradient came from."""
        local = {self.names[id(p)] for p, g in self._stepped_grads() if not torch.isfinite(g).all()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(local))
        bad = set().union(*everyone)
        return [name for name in self.names.values() if name in bad]

    def _stepped_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(param, reduced gradient) of everything this rank steps."""
        return [(p, g) for (p, _, _, _), g in zip(self._masters, self._grads)]

    # -- state dict: HF names and global offsets, independent of the mesh (hf3d/optim/state.py) -----
    def written_range(self, param: nn.Parameter) -> tuple[int, int]:
        """The flat range of `param` whose master and state this rank writes to a checkpoint (every element of
        the run by exactly one rank)."""
        raise NotImplementedError

    def state_keys(self) -> list[str]:
        """Names of the wrapped optimizer's per-element state on this rank (exp_avg, ...)."""
        return optim_state.state_keys(self)

    @property
    def num_steps(self) -> int:
        """Updates applied so far, as the wrapped optimizer counts them (0 before the first)."""
        return optim_state.num_steps(self)

    def group_settings(self) -> list[dict]:
        """Each parameter group's hyperparameters (lr, betas, weight_decay, ...), without its tensors."""
        return optim_state.group_settings(self)

    def state_dict(self) -> dict:
        """{"state": {hf_name: {key: [(hf_offsets, tensor), ...]}}, "step": n, "param_groups": [...]}: the
        boxes of global HF tensors this rank steps (its ZeRO shard), "master" (fp32 master weights) and
        the wrapped optimizer's per-element state (exp_avg, ...). No collective and no full tensors: the
        dicts of all ranks together cover every element, and `load_state_dict` reads any mesh's boxes."""
        return optim_state.state_dict(self)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load state_dict() output of any mesh (the "state" of several ranks merged: lists joined)."""
        optim_state.load_state_dict(self, state_dict)
        self._write_back()

    def _state_bytes(self) -> int:
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        return sum(map(precision.nbytes, states))

    @property
    def step_was_skipped(self) -> bool:
        """The last step() found a non-finite grad norm and left the weights unchanged."""
        return self.last_step_skipped


def no_decay_names(module: nn.Module) -> set[str]:
    """The parameters hf3d's default rule (exclude_from_weight_decay=True) does not decay: every bias and
    the weights of normalization layers (LayerNorm, RMSNorm and the model families' own *Norm classes,
    such as Qwen3's q_norm / k_norm). Embeddings and lm_head are decayed. This is the transformers
    Trainer's rule (Trainer.get_decay_parameter_names) on every supported family."""
    out = set()
    for mname, m in module.named_modules():
        is_norm = isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")
        for pname, _ in m.named_parameters(prefix=mname, recurse=False):
            if is_norm or "bias" in pname.rsplit(".", 1)[-1]:
                out.add(pname)
    return out


def _param_groups(grouped: list[tuple[torch.Tensor, float, bool]], par, *, with_no_decay: bool) -> list[dict]:
    """One group per (µP lr scale, weight decay or none) over the whole model's scales, so the same groups on
    every rank whatever its fragments hold; a µP group records its `lr_scale` (hf3d/optim/parametrization.py)."""
    scales = par.lr_scales() if par.rules else [1.0]
    groups = []
    for scale in scales:
        for no_decay in (False, True) if with_no_decay else (False,):
            group = {"params": [m for m, s, nd in grouped if s == scale and nd == no_decay]}
            if no_decay:
                group["weight_decay"] = 0.0
            if par.rules:
                group["lr_scale"] = scale
            groups.append(group)
    return groups


def _lr_scale(p: nn.Parameter, par) -> float:
    """The µP lr scale of a runtime parameter: its pieces' HF parameters share one rule (a fused qkv or
    gate_up projection, a stack of experts); a shard that holds only vocab padding has no piece and
    takes 1 (its elements never change)."""
    scales = {par.rule(piece.hf_name).lr_scale for piece in get_pieces(p)}
    assert len(scales) <= 1, f"the pieces of one parameter have different µP lr scales: {get_pieces(p)}"
    return scales.pop() if scales else 1.0


def owned_runs(p: torch.Tensor) -> list[tuple[int, int]]:
    """Flat [start, stop) runs of p's elements covered by pieces this rank owns (not replicas kept by
    another rank, not vocab padding)."""
    mask = torch.zeros(p.shape, dtype=torch.int8)
    for piece in get_pieces(p):
        if piece.owner:
            piece.local(mask).fill_(1)
    edges = torch.diff(torch.cat([mask.new_zeros(1), mask.flatten(), mask.new_zeros(1)])).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, z in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], z))
        else:
            out.append((a, z))
    return out


def tied_embedding_group(pmodel):
    """For tied embeddings split over two pipeline ranks: a group {first, last} per (dp, cp, tp) place.
    Every rank creates every group (new_group is collective)."""
    owners = pmodel.stage_owners
    if not pmodel.config.tie_word_embeddings or owners[0] == owners[-1]:
        return None
    ranks = pmodel.mesh.mesh.flatten(1)  # [pp, dp * cp * tp] -> global rank
    mine = None
    for place in range(ranks.shape[1]):
        pair = [int(ranks[owners[0], place]), int(ranks[owners[-1], place])]
        g = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = g
    return mine
