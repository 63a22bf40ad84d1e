"""A simple cost model of one optimizer step on each mesh: compute, the pipeline bubble, and the bytes each
rank's collectives move, turned into seconds with a device's peak FLOP/s and its links' bandwidths.

- compute: 6 x the matmul parameters a token meets + attention (PaLM's count, `flops_per_token`), over the
  tp x cp x pp ranks that share a row, plus a forward again under full recompute (the element-wise ops that
  selective recompute repeats cost next to nothing); at `mfu` of the device's peak.
- bubble: (pp - 1) / (m x v) of the compute (1f1b, interleaved over v stages per rank; afab the same);
- bytes per rank and step, each collective as a ring moves it ((n - 1) / n of the data):
  tp: 4 all-reduces of the hidden states per layer (2 forward, 2 backward; all-gather + reduce-scatter
  under sequence parallelism, the same bytes), plus one more forward's under full recompute;
  cp: each layer's K/V all-gathered forward and its gradient reduce-scattered backward;
  ep: 2 all-to-alls of the routed rows per MoE layer forward and 2 backward;
  pp: the hidden states of each micro-batch to the next stage and their gradient back;
  dp: ZeRO-1 reduce-scatters fp32 gradients and all-gathers the weights once a step; ZeRO-2 reduce-scatters
  once per micro-batch; ZeRO-3 gathers every layer forward and backward per micro-batch and reduce-scatters
  its fp32 gradient (FSDP2's mixed precision); ZeRO-0 all-reduces (twice the bytes of a reduce-scatter).
  tp and cp ride the node's links when tp x cp fits a node; dp, ep and pp cross nodes when there are several.
"""

from __future__ import annotations

import dataclasses

from ..parallel.stage import layer_costs


@dataclasses.dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s in the compute dtype, bytes/s per GPU inside a node and between nodes, the MFU the
    compute reaches."""

    name: str = "H100"
    peak_flops: float = 989e12  # bf16 dense (NVIDIA's H100 SXM sheet)
    intra_node: float = 450e9  # NVLink 4, each direction
    inter_node: float = 50e9  # 400 Gb/s InfiniBand per GPU
    mfu: float = 0.45
    gpus_per_node: int = 8


def flops_per_token(config, seq_len: int, mlp_costs: list[float] | None = None) -> float:
    """Training FLOPs per token: 6 * parameters of the matmuls a token meets + attention (PaLM appendix B).

    mlp_costs: each layer's MLP parameters a token meets, when the layers differ (a MoE family's adapter:
    the router, the top-k experts and a shared expert, `DecoderAdapter.mlp_costs`); default a dense SwiGLU."""
    embed, layers, _ = layer_costs(config, mlp_costs)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * d * seq_len
    return 6 * (sum(layers) + embed) + attention


@dataclasses.dataclass
class StepCost:
    seconds: float
    compute_s: float
    bubble: float  # fraction of the compute
    comm_bytes: dict[str, int]  # per rank and step, by axis
    comm_s: float


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_cost(config, pcfg, job, *, mlp_costs, param_elements: int, device: Device, nnodes: int) -> StepCost:
    """The step's seconds on `device`: compute + bubble + communication not hidden (all of it, conservatively)."""
    tokens = job.global_batch * job.seq_len
    flops = flops_per_token(config, job.seq_len, mlp_costs) * tokens
    if pcfg.recompute == "full":
        flops *= 8 / 6  # one more forward
    world = pcfg.tp * pcfg.pp * pcfg.dp * pcfg.cp
    compute = flops / world / (device.peak_flops * device.mfu)
    m, v = pcfg.num_microbatches, pcfg.virtual_stages if pcfg.pp > 1 else 1
    bubble = (pcfg.pp - 1) / (m * v) if pcfg.pp > 1 else 0.0
    comm = _comm_bytes(config, pcfg, job, param_elements=param_elements)
    fast = pcfg.tp * pcfg.cp <= device.gpus_per_node
    slow = nnodes > 1
    seconds = {
        "tp": comm["tp"] / (device.intra_node if fast else device.inter_node),
        "cp": comm["cp"] / (device.intra_node if fast else device.inter_node),
        "dp": comm["dp"] / (device.inter_node if slow else device.intra_node),
        "ep": comm["ep"] / (device.inter_node if slow else device.intra_node),
        "pp": comm["pp"] / (device.inter_node if slow else device.intra_node),
    }
    comm_s = sum(seconds.values())
    return StepCost(compute * (1 + bubble) + comm_s, compute, bubble, comm, comm_s)


def _comm_bytes(config, pcfg, job, *, param_elements: int) -> dict[str, int]:
    h, b = config.hidden_size, job.dtype_bytes
    rows_per_rank = job.global_batch // pcfg.dp
    local_tokens = rows_per_rank * job.seq_len // pcfg.cp  # this rank's tokens per step
    layers = config.num_hidden_layers / pcfg.pp  # this rank's
    passes = 3 if pcfg.recompute == "full" else 2  # forward, backward, and the recomputed forward
    tp = int(2 * passes * layers * local_tokens * h * b * _ring(pcfg.tp))
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = 2 * config.num_key_value_heads * d // min(pcfg.tp, config.num_key_value_heads)
    cp = int(passes * layers * local_tokens * kv * b * _ring(pcfg.cp) * pcfg.cp)  # gathers the whole sequence
    moe = getattr(config, "num_experts", 0) or 0
    k = getattr(config, "num_experts_per_tok", 0) or 0
    ep = int(2 * passes * layers * local_tokens * k * h * b * _ring(pcfg.ep)) if moe else 0
    pp = int(2 * local_tokens * h * b * (pcfg.virtual_stages if pcfg.pp > 1 else 0))
    shard = (pcfg.dp_shard or pcfg.dp) * pcfg.cp
    ring = _ring(shard)
    dp = {
        0: 2 * 4 * param_elements * ring,
        1: (4 + b) * param_elements * ring,
        2: (4 * pcfg.num_microbatches + b) * param_elements * ring,
        3: (2 * b + 4) * param_elements * ring * pcfg.num_microbatches,
    }[pcfg.zero_stage]
    return {"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": int(dp)}
