"""`hf3d plan CONFIG|MODEL --nproc N`: every mesh N ranks allow, each rank's bytes and the step's cost, the
meshes that fit ranked fastest first, and the mesh `hf3d train` would run marked. Offline: a model folder with
a config.json (or a YAML whose model.path is one) is all it reads; nothing is downloaded, allocated or launched."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..parallel.config import ParallelConfig
from ..utils.configfile import build_section, set_value
from ..utils.units import parse_size

HEADROOM = 0.9  # the share of the GPU the plan fills: the rest is CUDA's context, NCCL's buffers, fragmentation
GiB = 2**30
ATTENTION_KERNELS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")


def add_parser(sub, func) -> None:
    """`hf3d plan`'s options; `func(args)` runs it (the command line reads a train YAML into `args.train_config`
    and calls `run`)."""
    p = sub.add_parser(
        "plan",
        help="predict each rank's memory and the step's cost for every mesh N GPUs allow, offline, before launching",
    )
    p.add_argument("source", help="an hf3d train YAML, or a model folder (config.json) / config.json file")
    p.add_argument("--nproc", type=int, required=True, metavar="N", help="GPUs (processes) per node")
    p.add_argument("--nnodes", dest="plan_nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    p.add_argument("--gpu-memory", default="80GB", metavar="SIZE", help="memory per GPU: 80GB, 141GB, 24GiB")
    p.add_argument(
        "--seq-len", type=int, metavar="L", help="tokens per row (default: the YAML's data.seq_len, else 4096)"
    )
    p.add_argument("--global-batch", type=int, metavar="B", help="rows per step (default: the YAML's run.global_batch)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default: the YAML's, else bf16)")
    p.add_argument(
        "--fp8",
        choices=("off", "tensorwise", "rowwise"),
        help="FP8 recipe (default: the YAML's precision, else off): under ZeRO-3 tensorwise gathers weights in float8",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="whose attention kernel (default cuda)")
    p.add_argument("--unpacked", action="store_true", help="rows of one document each (no dense masks under sdpa)")
    p.add_argument(
        "--attn-implementation",
        choices=ATTENTION_KERNELS,
        help="the run's attention: auto, sdpa, eager, flash_attention_2, flex_attention (default: the YAML's, else "
        "auto, which picks flash_attention_2 on CUDA only where flash-attn is installed: on this machine, as planned)",
    )
    p.add_argument("--top", type=int, default=12, metavar="K", help="rows of the table (default 12)")
    p.add_argument("--json", action="store_true", help="print every mesh's plan as JSON instead of the table")
    p.add_argument(
        "--mesh",
        metavar="KEY=VALUE,...",
        help="the mesh to mark instead of the YAML's (parallel keys: tp=2,pp=2,zero_stage=3,recompute=selective,...)",
    )
    p.add_argument("--only-config", action="store_true", help="plan only the marked mesh (the YAML's or --mesh)")
    p.set_defaults(func=func)


def _read_source(args):
    """(HF config, the YAML's ParallelConfig or None, job defaults) from a YAML or a model folder."""
    from transformers import AutoConfig

    src, cfg = Path(args.source), getattr(args, "train_config", None)
    if cfg is not None:
        model_dir = Path(cfg.model.path)
        defaults = dict(seq_len=cfg.data.seq_len, global_batch=cfg.run.global_batch, dtype=cfg.model.dtype)
        defaults |= dict(state_precision=cfg.optim.state_precision, bucket_size=cfg.optim.bucket_size)
        defaults |= dict(attn=cfg.model.attn_implementation, packed=cfg.data.document_masking)
        defaults |= dict(fp8=cfg.precision.fp8_config())
        chosen = cfg.parallel
    else:
        model_dir, chosen = (src.parent if src.name == "config.json" else src), None
        defaults = dict(seq_len=4096, global_batch=None, dtype="bfloat16")
    if not (model_dir / "config.json").is_file():
        raise ValueError(
            f"{model_dir} has no config.json: hf3d plan reads a model's config offline; pass a model folder, its "
            "config.json, or a train YAML whose model.path is one"
        )
    return AutoConfig.from_pretrained(model_dir), chosen, defaults


def run(args) -> int:
    from ..models import get_adapter
    from ..parallel.attention import flash_attn_installed
    from ..parallel.compile import auto_compiles
    from ..parallel.fp8 import FP8Config
    from .cost import Device
    from .memory import Job
    from .meshes import check_mesh
    from .planner import Planner

    config, chosen, defaults = _read_source(args)
    adapter = get_adapter(config.model_type)
    memory = parse_size(args.gpu_memory, what="--gpu-memory")
    if args.nproc < 1 or args.plan_nodes < 1:
        raise ValueError(f"--nproc {args.nproc} and --nnodes {args.plan_nodes} must be positive")
    world = args.nproc * args.plan_nodes
    dtype = args.dtype or defaults["dtype"]
    attn = args.attn_implementation or defaults.get("attn", "auto")
    chosen_compile = chosen.compile if chosen is not None else "auto"  # hf3d train's default, as the run takes it
    job = Job(
        seq_len=args.seq_len or defaults["seq_len"],
        global_batch=args.global_batch or defaults["global_batch"] or world,
        dtype_bytes=4 if dtype == "float32" else 2,
        state_precision=defaults.get("state_precision", "fp32"),
        bucket_size=defaults.get("bucket_size", 2**22),
        target=args.device,
        packed=defaults.get("packed", True) and not args.unpacked,
        attn=attn,
        flash=args.device == "cuda" and flash_attn_installed(),
        compiled=chosen_compile is True or (chosen_compile == "auto" and auto_compiles(args.device)),
        fp8=FP8Config(args.fp8) if args.fp8 else defaults.get("fp8"),
    )
    device = Device(gpus_per_node=args.nproc)
    planner = Planner(config, job, adapter=adapter, device=device, nnodes=args.plan_nodes)
    train_mesh = _train_mesh(_mesh_option(args.mesh) if args.mesh else chosen, world)
    check_mesh(config, adapter, train_mesh, seq_len=job.seq_len, global_batch=job.global_batch, attn=job.attn)
    marked = planner.plan(train_mesh)
    marked.fits = marked.peak <= HEADROOM * memory
    plans = [] if args.only_config else best_per_mesh(planner, config, adapter, job, world, memory)
    if args.json:
        out = dict(job=dataclasses.asdict(job), gpu_memory=memory, headroom=HEADROOM)
        out["attention"] = planner.attention(train_mesh)
        out["train_mesh"] = _row(marked)
        out["meshes"] = [_row(p) for p in plans]
        print(json.dumps(out, indent=1))
        return 0
    _print_table(plans, marked, job, memory, args)
    print(_attention_line(planner, train_mesh, job))
    return 0


def _attention_line(planner, mesh: ParallelConfig, job) -> str:
    """Which attention kernel the plan counted on the marked mesh, and why where `auto` chose it."""
    from ..parallel.attention import AUTO, DENSE_MASK_ATTENTION, resolve_attn_implementation

    kernel = planner.attention(mesh)
    masks = "a dense mask per attention kind" if job.packed and kernel in DENSE_MASK_ATTENTION else "no dense mask"
    why = ""
    with_flash = resolve_attn_implementation(
        AUTO, job.target, document_masking=job.packed, flash_available=True, cp=mesh.cp, compiled=job.compiled
    )
    if job.attn == AUTO and not job.flash and with_flash != kernel:
        why = " (auto: flash-attn is not installed on this machine; --attn-implementation flash_attention_2 plans it)"
    return f"attention: {kernel}, {masks}{why}"


def _mesh_option(text: str) -> ParallelConfig:
    """--mesh tp=2,pp=2,...: a ParallelConfig, each KEY=VALUE read and checked as `hf3d train --set parallel.KEY=VALUE`
    reads it, with the YAML path's line for a key or value it cannot take."""
    values = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--mesh {item!r}: write KEY=VALUE pairs of parallel keys (tp=2,pp=2,zero_stage=3,...)")
        values[key.strip()] = set_value(item, value)
    try:
        return build_section(ParallelConfig, values, "parallel")
    except ValueError as e:
        raise ValueError(f"--mesh: {e}") from None


def _train_mesh(chosen: ParallelConfig | None, world: int) -> ParallelConfig:
    """The mesh `hf3d train` runs on `world` ranks: the YAML's parallel section (or --mesh), else the default (dp
    over all)."""
    pcfg = dataclasses.replace(chosen, compile=False) if chosen is not None else ParallelConfig()
    return pcfg.resolve(world)


def best_per_mesh(planner, config, adapter, job, world: int, memory: int) -> list:
    """For each mesh the fastest variant that fits, else its smallest; fitting ones first, fastest first. A mesh
    whose model the run would refuse as it assembles it (the trace's ValueError: FP8 on replicated KV heads) is
    left out."""
    from tqdm import tqdm

    from .meshes import candidate_meshes, variants

    meshes = candidate_meshes(config, adapter, world=world, seq_len=job.seq_len, global_batch=job.global_batch,
                              gpus_per_node=planner.device.gpus_per_node, attn=job.attn)  # fmt: skip
    out = []
    for mesh in tqdm(meshes, desc="hf3d plan: meshes", file=sys.stderr, disable=not sys.stderr.isatty()):
        best = smallest = None
        for pcfg in variants(mesh, global_batch=job.global_batch):
            try:
                plan = planner.plan(pcfg)
            except ValueError:
                break  # every variant of this mesh assembles the same model
            plan.fits = plan.peak <= HEADROOM * memory
            if plan.fits and (best is None or plan.cost.seconds < best.cost.seconds):
                best = plan
            if smallest is None or plan.peak < smallest.peak:
                smallest = plan
        if smallest is not None:
            out.append(best or smallest)
    return sorted(out, key=lambda p: (not p.fits, p.cost.seconds if p.fits else p.peak))


def _row(plan) -> dict:
    d = plan.as_dict()
    tokens = plan.pcfg.dp * plan.micro_batch * plan.pcfg.num_microbatches
    d |= dict(fits=plan.fits, peak_bytes=plan.peak, tokens_per_step_rows=tokens)
    return d


def _mesh_name(p: ParallelConfig) -> str:
    parts = [f"tp{p.tp}", f"pp{p.pp}", f"dp{p.dp}", f"cp{p.cp}"] + ([f"ep{p.ep}"] if p.ep > 1 else [])
    return " ".join(parts) + (f" {p.pp_schedule}" if p.pp > 1 else "")


def _print_table(plans: list, marked, job, memory: int, args) -> None:
    shown = plans[: args.top]
    if not any(_same(p, marked) for p in shown):
        shown = [*shown, marked]
    unit, per = ("GiB", GiB) if max(p.peak for p in shown) >= GiB else ("MiB", 2**20)
    rows = [table_row(p, marked, per) for p in shown]
    widths = [max(len(str(x)) for x in col) for col in zip(TABLE_HEAD, *rows)]
    print(
        f"hf3d plan: {args.nproc * args.plan_nodes} GPUs ({args.plan_nodes} node(s)) of {args.gpu_memory}, seq_len "
        f"{job.seq_len}, {job.global_batch} rows a step; {unit} per rank (the fullest rank), fits at <= "
        f"{HEADROOM:.0%} of the GPU; * = the mesh hf3d train runs"
    )
    for line in [TABLE_HEAD, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    fitting = (
        f"{sum(p.fits for p in plans)} of {len(plans)} meshes fit"
        if plans
        else "the marked mesh " + ("fits" if marked.fits else "does not fit")
    )
    print(f"{fitting}; comm GB: a rank's collective bytes a step; step s: the cost model's estimate, to rank them")


def _same(a, b) -> bool:
    return a.as_dict()["mesh"] == b.as_dict()["mesh"]


TABLE_HEAD = ["", "mesh", "zero", "recompute", "rows x m", "weights", "master", "grads", "state", "activ.", "total"]
TABLE_HEAD += ["comm GB", "step s"]


def table_row(p, marked, per: int) -> list[str]:
    """A plan's cells, in `per` bytes (the fullest rank's parts); * on the marked mesh."""
    r = max(p.ranks, key=lambda m: m.total)
    parts = (r.weights, r.master, r.grads, r.state + r.gathered, r.activations)
    total = f"{r.total / per:.1f}" + ("" if p.fits else " (no fit)")
    pcfg, mark = p.pcfg, "*" if marked is not None and _same(p, marked) else ""
    mesh = [_mesh_name(pcfg), str(pcfg.zero_stage), pcfg.recompute, f"{p.micro_batch} x {pcfg.num_microbatches}"]
    comm = f"{sum(p.cost.comm_bytes.values()) / 1e9:.3g}"  # a rank's bytes a step over every axis
    return [mark, *mesh, *[f"{x / per:.1f}" for x in parts], total, comm, f"{p.cost.seconds:.3g}"]
