"""The optimizer's state over this rank's master fragments, named independently of the mesh.

ParallelOptimizer steps flat fp32 fragments of the runtime parameters (a ZeRO shard of each bucket, or FSDP2's
shard of each parameter; tp slices, fused projections), so the wrapped torch optimizer's state is keyed by
fragments that exist on one mesh only. Both ways out of a run read and write it here, in HF names and global offsets:
`ParallelOptimizer.state_dict` / `load_state_dict` (in memory, any mesh) and checkpoint.py's DCP
entries `optim/<key>/<hf name>`. One module, so the two cannot drift apart:

- boxes: (key, hf_name, hf_offsets, sizes, view) over the fragments, for "master" (the fp32 master
  weights) and each per-element state tensor (exp_avg, exp_avg_sq, ...);
- the step: every element of a run has taken the same number of steps, so one integer is kept, and
  restored as torch itself places AdamW's `step`: a float32 scalar on the CPU, except for fused and
  capturable kernels, which read it on the parameter's device (CUDA's fused AdamW refuses a CPU step);
- the param-group settings: each group's hyperparameters without its tensors (lr, betas, ...).
"""

from __future__ import annotations

import torch

from ..parallel.layout import hf_boxes
from . import precision

MASTER_KEY = "master"


def state_keys(opt) -> list[str]:
    """Names of the wrapped optimizer's per-element state on this rank (exp_avg, ...)."""
    return sorted(
        {k for st in opt.optimizer.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
    )


def num_steps(opt) -> int:
    """Updates applied so far, as the wrapped optimizer counts them (0 before the first)."""
    return max((int(st["step"]) for st in opt.optimizer.state.values() if "step" in st), default=0)


def group_settings(opt) -> list[dict]:
    """Each parameter group's hyperparameters (lr, betas, weight_decay, ...), without its tensors."""
    return [
        {k: v.item() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}  # torchao: lr a tensor
        for g in opt.optimizer.param_groups
    ]


def state_boxes(opt, keys, *, create: bool, master: bool = True, owned_only: bool = False, my_shard: bool = False):
    """(key, hf_name, hf_offsets, sizes, view) over this rank's master fragments: MASTER_KEY (when
    `master`) and the state `keys`. `create` makes zero state where there is none yet (to be filled);
    `owned_only` skips replicas another tp rank owns and `my_shard` keeps only the range this rank writes
    (`opt.written_range`: under ZeRO-0 every rank holds every element, under HSDP every replica its shard):
    what one rank writes to a checkpoint."""
    if create:
        opt._unsettled = []
    whole_keys = getattr(opt, "whole_keys", ())  # Muon's: state of whole matrices (hf3d/optim/muon.py)
    fragment_keys = [k for k in keys if k not in whole_keys]
    for p, m, ga, gz in opt._masters:
        start = opt._flat_range[id(p)][0]
        a, z = ga, gz
        if my_shard:
            lo, hi = opt.written_range(p)
            a, z = max(ga, lo), min(gz, hi)
            if a >= z:
                continue
        st = opt.optimizer.state[m] if create and fragment_keys else opt.optimizer.state.get(m, {})
        sources = {MASTER_KEY: m} if master else {}
        for k in fragment_keys:
            sources[k] = state_source(opt, st, k, m, create=create)
        for key, flat in sources.items():
            for name, off, size, view in hf_boxes(p, flat, ga - start, a - start, z - start, owned_only=owned_only):
                yield key, name, off, size, view
    if whole_keys:
        mine = [k for k in keys if k in whole_keys]
        yield from opt.whole_boxes(mine, create=create, master=master, my_shard=my_shard)


def state_source(opt, st: dict, key: str, master: torch.Tensor, *, create: bool) -> torch.Tensor:
    """The fp32 tensor a checkpoint or state dict reads `st[key]` from, or a load writes it into: the state itself,
    or for a lower-precision state (hf3d/optim/precision.py) an fp32 copy that `settle` writes back after a load.
    `create` first makes the zero state the optimizer would keep."""
    if create and key not in st:
        st[key] = precision.new_state(opt.optimizer, master, key, opt.state_precision)
    t = st[key]
    if precision.is_plain_fp32(t):
        return t
    copy = precision.readable(t)
    if create:
        opt._unsettled.append((st, key, copy))
    return copy


@torch.no_grad()
def settle(opt) -> None:
    """After a load: the fp32 copies of lower-precision states into the states (rounded, or quantised)."""
    for st, key, copy in getattr(opt, "_unsettled", []):
        st[key].copy_(copy)
    opt._unsettled = []


def step_tensor(step: int, group: dict, master: torch.Tensor) -> torch.Tensor:
    """AdamW's `step` for a master of `group`, where torch puts it (Optimizer.load_state_dict's rule)."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=master.device if on_device else "cpu")


def restore_steps(opt, step: int) -> None:
    """Set the step of every master that has state (a fresh optimizer's are left to its first step)."""
    for group in opt.optimizer.param_groups:
        for m in group["params"]:
            if opt.optimizer.state.get(m):
                opt.optimizer.state[m]["step"] = step_tensor(step, group, m)


def check_group_scales(opt, saved: list[dict]) -> None:
    """The groups' µP lr scales must be the ones saved: the state of another parametrization (or base width)
    would restore each group's lr onto parameters of other rules."""
    kinds = sorted({_kind(g) for g in opt.optimizer.param_groups}), sorted({_kind(g) for g in saved})
    if saved and kinds[0] != kinds[1]:
        raise ValueError(
            f"the optimizer state was saved by {_optimizers(kinds[1])}, this run uses {_optimizers(kinds[0])}: resume "
            "with the optimizer it was trained with, or load the weights only (hf3d train: checkpoint.load_optimizer: "
            "false; Python: load_checkpoint(path, pmodel))"
        )
    mine = [g.get("lr_scale") for g in opt.optimizer.param_groups]
    theirs = [g.get("lr_scale") for g in saved]
    if saved and mine != theirs:
        raise ValueError(
            f"the optimizer state was saved under other µP lr scales ({_scales(theirs)}) than this run's "
            f"({_scales(mine)}): resume with the parametrization and mup_base_width it was trained with, or load "
            "the weights without the optimizer state"
        )


def restore_group_settings(opt, saved: list[dict]) -> None:
    """Saved hyperparameters into the groups, by key (tuples stay tuples: betas read back from JSON)."""
    check_group_scales(opt, saved)
    for group, settings in zip(opt.optimizer.param_groups, saved):
        for k, v in settings.items():
            if k not in group:
                continue
            if torch.is_tensor(group[k]):  # torchao's optimizers keep lr as a tensor and refuse a float there
                group[k].fill_(v)
            else:
                group[k] = type(group[k])(v) if isinstance(group[k], tuple) else v


def _kind(group: dict) -> str:
    """Muon's groups (hf3d/optim/muon.py) carry its Newton-Schulz settings; every other group is an element-wise one."""
    return "Muon" if "ns_steps" in group else "element-wise"


def _optimizers(kinds: list[str]) -> str:
    return "Muon with AdamW" if "Muon" in kinds else "an element-wise optimizer (AdamW, ...)"


def _scales(scales: list) -> str:
    return (
        "standard parametrization"
        if all(s is None for s in scales)
        else "spectral_mup, " + ", ".join(f"{s:g}" for s in sorted(set(scales), reverse=True))
    )


def state_dict(opt) -> dict:
    """{"state": {hf_name: {key: [(hf_offsets, tensor), ...]}}, "step": n, "param_groups": [...]}."""
    out: dict[str, dict] = {}
    for key, name, off, _, view in state_boxes(opt, state_keys(opt), create=False):
        out.setdefault(name, {}).setdefault(key, []).append((off, view.clone()))
    return {"state": out, "step": num_steps(opt), "param_groups": group_settings(opt)}


@torch.no_grad()
def load_state_dict(opt, sd: dict) -> None:
    """Fill this rank's fragments from state_dict() boxes of any mesh (several ranks' lists joined)."""
    keys = sorted({k for per_name in sd["state"].values() for k in per_name} - {MASTER_KEY})
    for key, name, off, size, view in state_boxes(opt, keys, create=True):
        covered = 0
        for soff, chunk in sd["state"].get(name, {}).get(key, []):
            lo = [max(o, so) for o, so in zip(off, soff)]
            hi = [min(o + n, so + c) for o, n, so, c in zip(off, size, soff, chunk.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            dst, src = view, chunk
            for d, (a, b) in enumerate(zip(lo, hi)):
                dst, src = dst.narrow(d, a - off[d], b - a), src.narrow(d, a - soff[d], b - a)
            dst.copy_(src)
            covered += dst.numel()
        if covered < view.numel():
            raise ValueError(f"optimizer state has no {key!r} for part of {name!r} at offsets {off}")
    settle(opt)
    if keys:  # no state saved: the optimizer starts fresh
        restore_steps(opt, sd["step"])
    restore_group_settings(opt, sd.get("param_groups", []))
