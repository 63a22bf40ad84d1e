"""What an FSDP configuration users already have asks of hf3d: the `ParallelConfig` fields it maps onto.

Three places carry one: an `accelerate launch --config_file` whose config has `distributed_type: FSDP` (the
launcher exports ACCELERATE_USE_FSDP, FSDP_VERSION, FSDP_RESHARD_AFTER_FORWARD, ... and, with a
`parallelism_config`, PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,TP,CP,SP}_SIZE), the Accelerator's
FullyShardedDataParallelPlugin and ParallelismConfig built from them, and the transformers Trainer's
`TrainingArguments(fsdp=..., fsdp_config=...)` (its `fsdp_plugin_args`). FSDP2 maps onto hf3d's own sharding:

| FSDP2 | hf3d |
| --- | --- |
| `reshard_after_forward: true` (FULL_SHARD) | `zero_stage=3` (FSDP2 itself, per decoder layer) |
| `reshard_after_forward: false` (SHARD_GRAD_OP) | `zero_stage=2` (weights whole, gradients and state sharded) |
| `dp_shard_size` x `dp_replicate_size` | `dp`, with `dp_shard` when replicated (HSDP) |
| `tp_size`, `cp_size` | `tp`, `cp` |
| `activation_checkpointing: true` | `recompute="full"` |

What cannot map is refused in one line: FSDP1 (`fsdp_version: 1`), CPU offload, accelerate's sequence
parallelism (`sp_size`, DeepSpeed Ulysses). The wrapping and state-dict keys (auto_wrap_policy, state_dict_type,
cpu_ram_efficient_loading, ...) are hf3d's own business (a group per decoder layer, its own sharded checkpoints)
and change nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

TRUE_WORDS = ("1", "true", "yes", "on")


def sharding_settings(
    *,
    version: int,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    sizes: Mapping[str, int] | None = None,
    where: str,
) -> dict:
    """The ParallelConfig fields an FSDP request asks for ({"zero_stage": 3, ...}); ValueError for what hf3d
    cannot honour. sizes: ParallelismConfig's dp_replicate / dp_shard / tp / cp / sp sizes, when there is one."""
    if int(version) != 2:
        raise ValueError(
            f"{where} asks for FSDP{int(version)}; hf3d runs FSDP2 (fsdp_version: 2), which it maps onto "
            "zero_stage 3 (reshard_after_forward: true) or 2 (false): set fsdp_version to 2"
        )
    if cpu_offload:
        raise ValueError(
            f"{where} asks for CPU offload of the parameters, which hf3d does not build: turn offload off and shard "
            "over more ranks (dp_shard_size), or use tensor / pipeline parallelism"
        )
    out: dict = {"zero_stage": 3 if reshard_after_forward else 2}
    if activation_checkpointing:
        out["recompute"] = "full"
    return out | mesh_settings(sizes, where=where)


def mesh_settings(sizes: Mapping[str, int] | None, *, where: str) -> dict:
    """dp, tp, cp (and dp_shard under HSDP) from ParallelismConfig's sizes; {} without them."""
    if not sizes:
        return {}
    if int(sizes.get("sp", 1)) > 1:
        raise ValueError(
            f"{where} asks for sequence parallelism sp_size={sizes['sp']} (DeepSpeed Ulysses), which hf3d does not "
            "run: use cp_size (hf3d's context parallelism) instead"
        )
    replicate, shard = int(sizes.get("dp_replicate", 1)), int(sizes.get("dp_shard", 1))
    out = {"dp": replicate * shard, "tp": int(sizes.get("tp", 1)), "cp": int(sizes.get("cp", 1))}
    if replicate > 1:
        out["dp_shard"] = shard
    return out


def launch_settings(environ: Mapping[str, str]) -> dict:
    """What an `accelerate launch` with an FSDP config asks for (its environment variables); {} without one."""
    if environ.get("ACCELERATE_USE_FSDP", "").lower() not in TRUE_WORDS:
        return {}
    sizes = None
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() in TRUE_WORDS:
        names = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
        sizes = {n: int(environ.get(f"PARALLELISM_CONFIG_{n.upper()}_SIZE", "1")) for n in names}
    return sharding_settings(
        version=int(environ.get("FSDP_VERSION", "1")),
        reshard_after_forward=environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in TRUE_WORDS,
        cpu_offload=environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in TRUE_WORDS,
        activation_checkpointing=environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() in TRUE_WORDS,
        sizes=sizes,
        where="the accelerate launch config (fsdp_config)",
    )


def training_args_settings(args) -> dict:
    """What `TrainingArguments(fsdp=..., fsdp_config=...)` asks for (its `fsdp_plugin_args`); {} without FSDP."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not plugin:
        return {}
    reshard = plugin.get("reshard_after_forward", True)
    return sharding_settings(
        version=int(plugin.get("fsdp_version", 1)),
        reshard_after_forward=reshard is not False and str(reshard).upper() != "SHARD_GRAD_OP",
        cpu_offload=bool(plugin.get("cpu_offload", False)),
        activation_checkpointing=bool(plugin.get("activation_checkpointing", False)),
        where="TrainingArguments(fsdp=..., fsdp_config=...)",
    )


def mismatches(pcfg, wanted: dict) -> list[str]:
    """`field=value` of each setting `wanted` names that the built model's ParallelConfig does not have."""
    return [f"{k}={v!r} (the model has {getattr(pcfg, k)!r})" for k, v in wanted.items() if getattr(pcfg, k) != v]
