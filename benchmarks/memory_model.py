"""Bytes per rank and bytes sent per step for hf3d training of a Llama-shaped decoder: a model to check.

Memory on one rank = training state + activations + a few buffers:

* state (hf3d's layout, optim.py): parameters P·a (a = bytes per param/activation element), fp32 main
  grads 4P, fp32 master weights 4P/dp under ZeRO-1 (none when params are fp32: they are their own
  master), AdamW's two fp32 moments 8P/dp (ZeRO-0: 4P and 8P, not divided). P = this rank's params:
  its pp stages' layers at 1/tp, norms replicated, the vocab-parallel embedding on the first stage,
  final norm + lm_head on the last (a tied lm_head on another pp rank is a second copy).
* activations: what autograd saves per token per decoder layer, derived op by op for HF's Llama
  layer with hf3d's fused projections, sdpa on CPU (flash kernel, GQA without repeat_kv, causal
  without a mask), fp32 — LAYER_TERMS below; tests/test_benchmarks.py checks it against the storages
  a saved_tensors_hooks counts. Per micro-batch alive at once: pp=1 runs one micro-batch's forward
  and backward at a time; afab keeps all m alive, 1f1b at most pp − r on pipeline rank r,
  interleaved-1f1b torch's warm-up (v−1)·pp + 2(pp−1−r) + 1 chunks. At the start of backward, beside
  them: the last layer's MLP gradients, [tokens, intermediate/tp] for the down_proj input and twice
  that for the fused gate_up output (backward_transient).
* loss head (last stage). At pp=1 and under 1f1b train_step runs the fused head
  (tensor_parallel._FusedHeadLoss): no [tokens, vocab] logits, but the weight's gradient (fp32,
  [vocab/tp, hidden]) and the hidden states' gradient are made in its forward, beside one chunk of
  logits at a time (HEAD_CHUNK fp32 values per row and local vocab column); 1f1b's last stage runs
  each micro-batch's backward right after its forward. Under the other schedules the plain head runs:
  HEAD_LIVE bytes per token per local vocab column for each live micro-batch (the saved log-softmax /
  exp) and HEAD_PEAK more while one micro-batch's loss runs backward (logits and their gradients);
  run_pipeline passes return_outputs=False, so the schedule keeps no logits past the step. The six
  meshes bench_memory_model.py checks all run 1f1b: this plain-head-under-pp term is not checked.
* pipeline receive buffers: torch's PipelineStage allocates one activation buffer (non-first stage)
  and one gradient buffer (non-last stage) per micro-batch, kept for the model's life.

Communication, bytes each rank sends per step under the ring model (all-reduce 2(n−1)/n × bytes,
reduce-scatter and all-gather (n−1)/n × the full buffer): tp — per micro-batch and layer 2
all-reduces of [tokens, hidden] forward and 2 backward, one for the embedding, one for the lm_head's
input gradient, 3 [tokens] fp32 vectors for the vocab-parallel loss; pp — the activation forward and
its gradient backward, [tokens, hidden] per micro-batch per stage boundary; dp — the fp32 grad buffer
(all-reduce, or reduce-scatter — as such or as gloo's all-to-all and local sum) and, under ZeRO-1, the
params gathered: an all-gather (or one broadcast per shard) after a reduce-scatter, an all-reduce of
the zero-padded buffer after an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

HEAD_LIVE = 2.0  # fp32 values per token per local vocab column saved per live micro-batch: logits + log-softmax
HEAD_PEAK = 2.0  # more while one micro-batch's loss runs backward: d(log-softmax) and d(logits)
HEAD_CHUNK = 1.0  # fp32 values per row per local vocab column of the fused head's one live chunk of logits


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder (no biases)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None

    @classmethod
    def from_config(cls, c) -> Shape:
        return cls(
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.intermediate_size,
            c.vocab_size,
            bool(c.tie_word_embeddings),
            getattr(c, "head_dim", None),
        )

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def params(self) -> int:
        per_layer = self.hidden * self.d * (2 * self.heads + 2 * self.kv_heads) + 3 * self.hidden * self.inter
        return self.layers * (per_layer + 2 * self.hidden) + self.hidden + self.vocab * self.hidden * (2 - self.tied)


@dataclass(frozen=True)
class Run:
    """One job: degrees, batch (per dp rank: microbatches × rows, each seq tokens) and precision."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    microbatches: int = 1
    rows: int = 1  # per micro-batch
    seq: int = 128
    param_bytes: int = 4
    zero_stage: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dp_collective: str = "all_reduce"

    @property
    def tokens(self) -> int:  # per micro-batch
        return self.rows * self.seq


def local_heads(s: Shape, tp: int) -> tuple[int, int]:
    return s.heads // tp, max(1, s.kv_heads // tp)


def layer_params(s: Shape, tp: int) -> int:
    q, kv = local_heads(s, tp)
    return s.hidden * (q + 2 * kv) * s.d + q * s.d * s.hidden + 3 * s.hidden * (s.inter // tp) + 2 * s.hidden


def layer_activation_bytes(s: Shape, tp: int, a: int = 4) -> int:
    """Bytes autograd saves per token in one decoder layer (LAYER_TERMS summed)."""
    return sum(n for _, n in LAYER_TERMS(s, tp, a))


def LAYER_TERMS(s: Shape, tp: int, a: int = 4) -> list[tuple[str, int]]:  # noqa: N802 (a table)
    q, kv, h, d, i = *local_heads(s, tp), s.hidden, s.d, s.inter // tp
    return [
        ("layer input and normed (input_layernorm's input, qkv_proj's)", 2 * h * a),
        ("residual and normed (post_attention_layernorm's input, gate_up_proj's)", 2 * h * a),
        ("rsqrt of both norms (fp32)", 2 * 4),
        ("fused qkv output (v, a view of it, is an sdpa input)", (q + 2 * kv) * d * a),
        ("q, k after rotary (sdpa inputs)", (q + kv) * d * a),
        ("sdpa output [b, s, heads, d] (also the o_proj input)", q * d * a),
        ("sdpa logsumexp (fp32)", q * 4),
        ("fused gate_up output (the SwiGLU's only saved input)", 2 * i * a),
        ("silu(gate)·up (down_proj input)", i * a),
    ]


def vocab_local(s: Shape, tp: int) -> int:
    return -(-s.vocab // tp)


def stage_layout(s: Shape, run: Run) -> tuple[list[list[int]], list[int]]:
    """hf3d's own split (hf3d.stage): layers per stage and the pipeline rank of each stage."""
    from hf3d.stage import layer_costs, split_layers, stage_ranks

    cfg = SimpleNamespace(
        hidden_size=s.hidden,
        intermediate_size=s.inter,
        head_dim=s.d,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        num_hidden_layers=s.layers,
        vocab_size=s.vocab,
    )
    n = run.pp * (run.virtual_stages if run.pp > 1 else 1)
    return split_layers(n, *layer_costs(cfg)), stage_ranks(n, run.pp, run.schedule)


def live_chunks(run: Run, rank: int) -> int:
    p, m, v = run.pp, run.microbatches, run.virtual_stages
    if p == 1:
        return 1
    if run.schedule == "afab":
        return m
    if run.schedule == "1f1b":
        return min(m, p - rank)
    return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1)


def rank_memory(s: Shape, run: Run, rank: int) -> dict[str, float]:
    """Predicted bytes on pipeline rank `rank` (every tp/dp rank of it alike, up to padding)."""
    split, owners = stage_layout(s, run)
    mine = [i for i, o in enumerate(owners) if o == rank]
    first, last = 0 in mine, len(owners) - 1 in mine
    h, a, tokens, m = s.hidden, run.param_bytes, run.tokens, run.microbatches
    vocab = vocab_local(s, run.tp)
    num_layers = sum(len(split[i]) for i in mine)
    p = num_layers * layer_params(s, run.tp) + (vocab * h if first else 0)
    if last:
        p += h + (vocab * h if (not s.tied or not first) else 0)
    shard = 1 / run.dp if run.zero_stage == 1 else 1
    out = {
        "params": p * a,
        "main_grads": 4 * p,
        "master_weights": 0 if a == 4 else 4 * p * shard,
        "optimizer_state": 8 * p * shard,
    }
    # activations: the layers of the chunks alive at once (chunks of one rank hold similar layer counts)
    chunk_layers = num_layers / len(mine)
    extra = 2 * s.d * a + (8 if first else 0) + (2 * h * a + 4 if last else 0)  # cos/sin, ids, final norm
    live = live_chunks(run, rank)
    out["activations"] = live * tokens * (chunk_layers * layer_activation_bytes(s, run.tp, a) + extra)
    # the last layer's MLP backward, while every other saved tensor is still alive: the gradient of the
    # down_proj input and the fused gate_up gradient made from it
    out["backward_transient"] = 3 * tokens * (s.inter // run.tp) * a
    head = 0.0
    if last and (run.pp == 1 or run.schedule == "1f1b"):  # the fused head (hf3d.pipeline)
        from hf3d.tensor_parallel import loss_chunk_rows

        rows = min(tokens, loss_chunk_rows("cpu", vocab))
        head = 4 * vocab * h + tokens * h * a + HEAD_CHUNK * 4 * rows * vocab
    elif last:  # the plain head under the other schedules: each live micro-batch's saved softmax, one backward
        head = tokens * vocab * 4 * (live * HEAD_LIVE + HEAD_PEAK)
    out["loss_head"] = head
    out["pp_buffers"] = 0 if run.pp == 1 else m * tokens * h * a * ((not first) + (not last)) * len(mine)
    out["total"] = sum(out.values())
    return out


def rank_comm(s: Shape, run: Run, rank: int) -> dict[str, float]:
    """Predicted bytes this rank sends per step on each axis (ring model)."""
    split, owners = stage_layout(s, run)
    mine = [i for i, o in enumerate(owners) if o == rank]
    first, last = 0 in mine, len(owners) - 1 in mine
    m, tokens = run.microbatches, run.tokens
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731  (all-reduce; reduce-scatter and all-gather send half)
    act = tokens * s.hidden * run.param_bytes  # one micro-batch's [tokens, hidden]
    tp = 0.0
    if run.tp > 1:
        num_layers = sum(len(split[i]) for i in mine)
        tp = m * ring(run.tp) * (act * (4 * num_layers + first + last) + (3 * tokens * 4 if last else 0))
    pp = 0.0
    for i in mine:
        sends_act = i + 1 < len(owners) and owners[i + 1] != rank
        sends_grad = i > 0 and owners[i - 1] != rank
        pp += m * act * (sends_act + sends_grad)
    p = rank_memory(s, run, rank)["main_grads"] / 4
    dp = 0.0
    if run.dp > 1:
        grads = ring(run.dp) * (1 if run.zero_stage == 0 or run.dp_collective == "all_reduce" else 0.5)
        gather = ring(run.dp) * (1 if run.dp_collective == "all_reduce" else 0.5)
        dp = grads * 4 * p + (gather * run.param_bytes * p if run.zero_stage == 1 else 0)
    return {"tp": tp, "pp": pp, "dp": dp}


def predict(s: Shape, run: Run) -> dict:
    """Per pipeline rank memory and communication, and the worst rank's total."""
    ranks = [{"memory": rank_memory(s, run, r), "comm": rank_comm(s, run, r)} for r in range(run.pp)]
    worst = max(range(run.pp), key=lambda r: ranks[r]["memory"]["total"])
    return {"ranks": ranks, "worst_rank": worst, "worst_total": ranks[worst]["memory"]["total"]}
