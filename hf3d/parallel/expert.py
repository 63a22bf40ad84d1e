"""Expert parallelism: dropless token dispatch over the expert group, grouped expert GEMMs, and the
router statistics of the load-balancing loss.

Each MoE layer's E experts are split over the ep ranks of an expert group, E/ep each in order (rank j
holds experts [j*E/ep, (j+1)*E/ep)). A layer's step, per rank (hf3d/models/moe.py drives it):

1. the router picks top-k experts per token; the (token, expert) assignments are sorted by expert, so
   by destination rank, with stock's own call (`torch.sort`, not stable, as transformers' grouped_mm
   experts sort them): each expert sees its rows in stock's order, so its weight gradient, a sum over
   those rows, rounds as stock's does;
2. the per-expert counts go all-to-all, then the tokens (`all_to_all_single`, variable splits): no
   capacity factor, no token dropped, so the arithmetic is stock's;
3. the received tokens are regrouped by local expert and run as one grouped GEMM per projection
   (`torch._grouped_mm`), or a loop over experts where torch has no grouped GEMM;
4. the outputs go back by the inverse all-to-all, are weighted by the router, put back in (token, top-k
   slot) order and summed over each token's k slots, as stock's grouped_mm experts sum them.

Every step is differentiable: the adjoint of an all-to-all is the all-to-all with the splits swapped.

No host sync inside a layer but one: at ep > 1 the all-to-all needs its split sizes on the host, read
once per layer's forward (the rows to send to and to receive from each rank, in one small tensor); the
backward swaps the same lists. Everything else stays on the device, sized by what the host knows already
(tokens x top-k): counts are scatter-adds (bincount reads its largest value to size its output), the
grouped GEMMs take their offsets as a device tensor, repeat_interleave is told its output size, and no
boolean mask, nonzero or unique sizes a tensor by its data. tests/test_moe_syncs.py counts them.

Router statistics (`RouterStats`): stock's load-balancing loss multiplies the top-k pick counts and the
router probabilities, each summed over every MoE layer and token of one forward. Its gradient reaches
each layer's probabilities scaled by the counts of the whole forward, which a pipeline stage does not
know when its own layers run. So the [2, E] (counts, probability sums) travel as one more activation
from stage to stage, layer by layer (`_Tally`), and the last stage closes the forward (`_Close`): it
sums the shards of one forward's rows (tp under sequence parallelism, cp) and sends the totals back
as that tensor's gradient, which every layer's tally reads in its backward. Without a pipeline the same
chain lives inside one stage. The arithmetic is stock's `load_balancing_loss_func` step for step: a softmax
of the router logits of its own (whose backward adds to the router's at the logits, as stock's does), and
the probability sums' gradient coef * E * (counts / n) / n in stock's order of fp32 operations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

LOAD_BALANCE = ("aux_loss", "bias", "none")


def check_load_balance(balance: str, rate: float, keys: tuple[str, str] = ("moe_load_balance", "moe_bias_rate")):
    if balance not in LOAD_BALANCE:
        raise ValueError(f"{keys[0]} must be one of {', '.join(LOAD_BALANCE)}, got {balance!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0 or rate == float("inf"):
        raise ValueError(f"{keys[1]} (the expert bias update rate) must be a finite number >= 0, got {rate!r}")


def _trivial(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


class _AllToAll(torch.autograd.Function):
    """Rows of x, `send[j]` of them to rank j, in rank order; receives `recv[j]` rows from rank j."""

    received_bytes = 0  # by this process from other ranks, forward and backward (benchmarks read it)

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    me = dist.get_rank(group)
    _AllToAll.received_bytes += (sum(recv) - recv[me]) * out[:1].numel() * out.element_size()
    return out


def all_to_all_bytes() -> int:
    """Bytes this process has received from other ranks in the token exchanges so far."""
    return _AllToAll.received_bytes


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[g-1]:offsets[g] of x times weight[g]^T for each g: weight [G, out, in], x [T, in].

    torch's grouped GEMM takes the offsets on the device; its CUDA kernel reads them there for bf16 on sm90 and
    sm100 (H100/H200, B200), while its fallback (other dtypes or GPUs, and CPU) copies them to the host."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    bounds = [0, *offsets.tolist()]  # no grouped GEMM in this torch: one matmul per group, a host read
    return torch.cat([x[bounds[g] : bounds[g + 1]] @ weight[g].t() for g in range(weight.shape[0])])


def expert_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 on top_k_index's device: how many (token, expert) assignments go to each expert. A scatter-add
    into E slots, not torch.bincount, which reads the largest id on the host to size its output."""
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class Dispatch:
    """One layer's token exchange: `send` moves each (token, expert) assignment's row to the rank holding
    that expert, grouped by local expert; `combine` brings the expert outputs back and sums each token's
    outputs weighted by the router.

    top_k_index [T, k]: each token's experts (global ids); num_experts: E; group: the expert group."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, group):
        self.group = None if _trivial(group) else group
        ep = 1 if self.group is None else dist.get_world_size(self.group)
        self.num_tokens, self.k = top_k_index.shape
        self.num_local = num_experts // ep
        flat = top_k_index.reshape(-1)
        # assignments by expert, so by rank: stock's sort (transformers' grouped_mm experts), so that each expert's
        # rows, and the sum over them that is its weight gradient, come in stock's order
        self.order = torch.sort(flat).indices
        self.rows = self.order // self.k  # the token of each sorted assignment
        counts = expert_counts(flat, num_experts)
        if self.group is None:  # nothing to exchange: the counts stay on the device as the GEMMs' groups
            self.send = self.recv = self.regroup = None
            self.tokens_per_expert = counts
            return
        received = torch.empty_like(counts)  # received[j * E_local + e]: rows from rank j for local expert e
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, self.num_local)
        # the layer's one host read: the rows to send to each rank and to receive from each rank
        splits = torch.stack([counts.view(ep, self.num_local).sum(1), received.sum(1)])  # [2, ep]
        self.send, self.recv = splits.tolist()
        self.tokens_per_expert = received.sum(0)
        # the received rows come rank by rank, each rank's by local expert; the GEMMs want them by expert
        key = torch.arange(received.numel(), device=counts.device).view(self.num_local, ep).t().flatten()
        # key[j * E_local + e] = e * ep + j: where block (rank j, expert e) goes in (expert, rank) order
        blocks = torch.repeat_interleave(key, received.flatten(), output_size=sum(self.recv))
        self.regroup = torch.sort(blocks, stable=True).indices

    def send_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] -> this rank's rows [R, h], grouped by local expert (`tokens_per_expert` each)."""
        rows = x[self.rows]
        if self.group is None:
            return rows
        rows = _AllToAll.apply(rows, self.send, self.recv, self.group)
        return rows[self.regroup]

    def combine(self, y: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Expert outputs y [R, h] (grouped like send_tokens' rows) -> [T, h]: each token's outputs times
        its router weights, summed over its k slots in slot order, as transformers' grouped_mm experts do
        (`weighted[inverse].view(T, k, h).sum(1)`: the same sum, and a deterministic one where index_add's
        atomics are not)."""
        if self.group is not None:
            back = torch.empty_like(self.regroup)
            back[self.regroup] = torch.arange(len(self.regroup), device=back.device)
            y = _AllToAll.apply(y[back], self.recv, self.send, self.group)
        weighted = y * top_k_weights.reshape(-1)[self.order].unsqueeze(-1)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(len(self.order), device=inverse.device)
        return weighted[inverse].view(self.num_tokens, self.k, -1).sum(dim=1)


# -- the load-balancing loss across layers and stages --------------------------------------------------


class _Tally(torch.autograd.Function):
    """chain + (this layer's pick counts, probability sums); backward: the chain's gradient holds the
    forward's total counts, so the probability sums' gradient is coef * E * (counts / n) / n, n the forward's
    rows times MoE layers. The order of its fp32 operations is autograd's through stock's loss
    (`E * sum((counts / n) * (prob_sums / n))`, weighted by coef): (coef * E) * (counts / n), then / n."""

    @staticmethod
    def forward(ctx, chain, prob_sums, counts, coef: float, num_experts: int, n: int):
        ctx.coef, ctx.num_experts, ctx.n = coef, num_experts, float(n)
        return chain + torch.stack([counts, prob_sums.detach()])

    @staticmethod
    def backward(ctx, grad):
        per_loss = grad.new_full((), ctx.coef) * ctx.num_experts
        return grad, per_loss * (grad[0] / ctx.n) / ctx.n, None, None, None, None


class _Close(torch.autograd.Function):
    """The end of one forward's chain: 0 in the forward (the loss term enters through the tallies'
    backward), and the total counts as the chain's gradient."""

    @staticmethod
    def forward(ctx, chain, totals):
        ctx.save_for_backward(totals)
        return chain.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        (totals,) = ctx.saved_tensors
        out = torch.zeros_like(totals)
        out[0] = totals[0] * grad
        return out, None


class RouterStats:
    """A MoE model's router statistics: the expert load of each train_step, and the chain of one forward's
    statistics for stock's load-balancing loss when the config asks for it (see the module docstring).

    num_experts: E; layers: the global ids of the model's MoE layers; aux: whether train_step adds the
    load-balancing loss; shard_groups: the groups over which one forward's rows are split (tp under sequence
    parallelism, cp). `coef` (stock's router_aux_loss_coef over the forwards of a step) and `rows` (of one
    forward, over all its shards) are set by each train_step."""

    def __init__(
        self, num_experts: int, layers: list[int], *, aux: bool, shard_groups: list, balance: str = "aux_loss"
    ):
        self.num_experts, self.layers, self.balance = num_experts, list(layers), balance
        self.aux = aux and balance == "aux_loss"
        self.num_layers = len(self.layers)
        self.bias_rate = 1e-3
        # balance "bias": a per-expert bias added to the router's scores when it picks the top k (not to the
        # weights), raised for under-loaded experts and lowered for over-loaded ones after every step
        self.bias = torch.zeros(self.num_layers, num_experts) if balance == "bias" else None
        self.shard_groups = [g for g in shard_groups if not _trivial(g)]
        self.coef, self.rows = 0.0, 0
        self.chain: torch.Tensor | None = None  # set by a stage while it records the loss's statistics
        self.load: torch.Tensor | None = None  # [MoE layers, E] top-k picks of this rank's tokens, this step
        self.global_load: torch.Tensor | None = None

    def step_load(self, copies: int) -> torch.Tensor | None:
        """Collective over the world, once per step: the step's top-k picks summed over every rank, divided by
        the number of ranks that routed the same tokens (`copies`); None before the first train_step."""
        if self.load is not None and self.global_load is None:
            load = self.load.clone()
            dist.all_reduce(load)
            self.global_load = load / copies
        return self.global_load

    def start_step(self, device) -> None:
        self.load = torch.zeros(self.num_layers, self.num_experts, device=device)
        self.global_load = None  # the step's load over every rank (ParallelModel.expert_load)
        if self.bias is not None:
            self.bias = self.bias.to(device)

    def pick(self, layer: int, probs: torch.Tensor, k: int) -> torch.Tensor:
        """The top-k experts of each token under this balance: by probability, or by probability + bias."""
        if self.bias is None:
            return torch.topk(probs, k, dim=-1).indices
        return torch.topk(probs + self.bias[self.layers.index(layer)], k, dim=-1).indices

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """After a step, from its global load [MoE layers, E]: bias += rate * sign(mean load - load)."""
        if self.bias is not None:
            self.bias += self.bias_rate * torch.sign(load.mean(dim=1, keepdim=True) - load)

    def state_dict(self) -> dict:
        return {"balance": self.balance, "bias": None if self.bias is None else self.bias.cpu()}

    def load_state_dict(self, state: dict) -> None:
        if self.bias is not None and state.get("bias") is not None:
            self.bias = state["bias"].to(self.bias.device)

    def start(self, chain: torch.Tensor | None, device) -> None:
        """A stage begins recording: the chain from the previous stage, or a fresh one."""
        self.chain = chain if chain is not None else torch.zeros(2, self.num_experts, device=device, requires_grad=True)

    def stop(self) -> torch.Tensor:
        chain, self.chain = self.chain, None
        return chain

    def tally(self, layer: int, probs: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """MoE layer `layer`'s router output: probs [T, E] (fp32 softmax), top_k_index [T, k]. Under the
        load-balancing loss, probs is a softmax of the router logits of the loss's own, as stock's is, not the
        router's: its gradient reaches the logits through a softmax backward of its own, added to the
        router's there. A forward run again by activation recompute (inside backward) counts nothing."""
        if torch._C._current_graph_task_id() != -1:
            return
        counts = expert_counts(top_k_index, self.num_experts).to(torch.float32)
        if self.load is not None:
            self.load[self.layers.index(layer)] += counts
        if self.chain is not None:
            n = self.rows * self.num_layers
            self.chain = _Tally.apply(self.chain, probs.sum(0), counts, self.coef, self.num_experts, n)

    def close(self, chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(term to add to the objective, stock's load-balancing loss of this forward)."""
        totals = chain.detach().clone()
        for group in self.shard_groups:
            dist.all_reduce(totals, group=group)
        n = float(self.rows * self.num_layers)
        aux = torch.sum(totals[0] / n * (totals[1] / n)) * self.num_experts  # stock's order
        return _Close.apply(chain, totals), aux


def aux_stats(stats: RouterStats | None) -> RouterStats | None:
    """The statistics when train_step adds the load-balancing loss (a MoE model, `aux_loss` balance and the
    config's output_router_logits), else None."""
    return stats if stats is not None and stats.aux else None


def close_forward(stats: RouterStats | None, cp_rank: int, objective: torch.Tensor, chain: torch.Tensor | None):
    """(objective with the load-balancing term attached, this forward's load-balancing loss on the first cp
    rank, 0 elsewhere: the step's sum over dp x cp then counts each forward once)."""
    if chain is None:
        return objective, torch.zeros((), device=objective.device)
    term, aux = stats.close(chain)
    return objective + term, aux if cp_rank == 0 else torch.zeros_like(aux)


def load_imbalance(load: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
    """The imbalance max / mean of the expert load [MoE layers, E] (top-k picks over the whole step), overall
    and of each layer (1.0 is perfect balance), as 0-d tensors on load's device: a caller can read them in a
    host sync it makes anyway (the optimizer's `read_with_step`)."""
    per_layer = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
    out = {"moe/load_imbalance": per_layer.max()}
    out.update({f"moe/load_imbalance/layer{i}": v for i, v in zip(layers, per_layer.unbind())})
    return out


def mark_expert(param: nn.Parameter) -> None:
    """A parameter split over the expert group: reduced over the expert data-parallel ranks only."""
    param.hf3d_expert = True


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "hf3d_expert", False)
