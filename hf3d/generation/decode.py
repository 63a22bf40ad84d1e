"""KV-cached decoding of a ParallelModel at its own mesh: `ParallelModel.generate`.

What transformers' `generate` does for a decoder-only model, run over hf3d's stages:
- the prompts come left-padded with their 2D attention mask, position ids `cumsum(mask) - 1` (pads at 1), as
  stock builds them; the prefill runs the whole batch, then one token per step;
- the cache is transformers' own `DynamicCache(config=...)`, one per rank and call: each decoder layer writes
  its keys and values at its own layer index, so a tp rank's entries hold its own KV heads and a pipeline stage
  fills only its layers' entries (sliding-window layers get stock's sliding layers). The masks are stock's
  `create_causal_mask` / `create_sliding_window_causal_mask` over the cache, sized on this stage's first layer
  of each kind (a stage without layer 0 would otherwise read an empty entry);
- the last stage's normed hidden state of the last position goes through the vocab-parallel head, the full
  vocabulary is gathered over tp and the logits go to every pipeline rank in one broadcast, so every rank of
  the replica picks the same token: argmax, or with do_sample stock's warpers (`TemperatureLogitsWarper`,
  `TopKLogitsWarper`, `TopPLogitsWarper`) and one draw per row from a CPU generator seeded with `seed` and the
  row's prompt (RowDraws), identical on every rank, mesh and batch. EOS, stop strings and the length end a row
  through stock's stopping criteria (the stop strings looked for in the decoded new text: StopText); a finished
  row is padded, and the call ends when every row has finished.
- sequence parallelism splits a sequence over tp, which one new token cannot be: its modules run as plain tp
  while decoding (the same weights, all-reduce instead of reduce-scatter + all-gather). Context parallelism
  splits the prefill (SplitPrefill: each cp rank runs its chunks, the keys and values are gathered once into
  every rank's cache); the steps then run the whole rows on every cp rank. Expert parallelism: the dp ranks of an
  expert group run their forwards together (the experts answer each other's tokens), so a rank whose rows
  have finished goes on with padding until the whole group has.
"""

from __future__ import annotations

import contextlib
import copy
import os
import zlib

import torch
import torch.distributed as dist
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..parallel.pipeline import relay_forward

OPTIONS = (
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "stop_strings",
    "tokenizer",
    "output_logits",
    "return_dict_in_generate",
    "generation_config",
    "seed",
    "use_cache",
)


class Step:
    """One decoding forward's cache and 2D attention mask [b, cached + new]: what StageModule.forward takes
    as `decode`."""

    split_over_cp = False

    def __init__(self, cache, attention_mask: torch.Tensor):
        self.cache, self.attention_mask = cache, attention_mask

    def masks(self, stage, shape_probe: torch.Tensor, position_ids: torch.Tensor) -> dict:
        out = {}
        for kind in stage.kinds:
            build = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            out[kind] = build(
                config=stage.config,
                inputs_embeds=shape_probe,
                attention_mask=self.attention_mask,
                cache=self.cache,
                position_ids=position_ids,
                layer_idx=stage.layer_ids[stage.layer_types.index(kind)],
            )
        return out


class SplitPrefill:
    """The prefill under context parallelism: every cp rank runs its 2 of 2*cp chunks of the rows (the cp
    masks keep the left padding apart: a pad's position never follows its neighbour's, so each pad is a
    document of its own), and `cache` records each layer's keys and values of those chunks as they pass;
    `fill` then gathers them over cp, in sequence order, into the real cache, whose layers keep them as
    stock's cache would (a sliding-window layer its last window)."""

    split_over_cp = True

    def __init__(self):
        self.cache = self
        self.recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.recorded[layer_idx] = (keys, values)
        return keys, values

    def fill(self, cache, cp) -> None:
        for layer_idx, (keys, values) in sorted(self.recorded.items()):  # [b, kv_heads_local, 2c, d]
            cache.update(cp.gather(keys, dim=2), cp.gather(values, dim=2), layer_idx)


@contextlib.contextmanager
def plain_tensor_parallel(pmodel):
    """Sequence parallelism off while decoding (the modules' `sequence_parallel` flags), back on after."""
    switched = [m for m in pmodel.hf_model.modules() if getattr(m, "sequence_parallel", False) is True]
    for m in switched:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in switched:
            m.sequence_parallel = True


def next_logits(pmodel, ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
    """Full-vocabulary logits [b, V] (fp32) of the last position of `ids`, on every rank of the replica."""
    split = step.split_over_cp
    local_ids = pmodel.cp.split(ids) if split else ids
    if pmodel.pcfg.pp == 1:
        hidden = pmodel.stages[0](local_ids, position_ids=positions, head=False, decode=step)
    else:
        hidden = relay_forward(pmodel, local_ids, positions, head=False, decode=step)
    b = ids.shape[0]
    logits = torch.empty(b, pmodel.config.vocab_size, dtype=torch.float32, device=pmodel.device)
    if hidden is not None:
        if split:  # the last position is in cp rank 0's second chunk: the rows put back together
            hidden = pmodel.cp.gather(hidden)
        head = pmodel.lm_head
        last = head.local_logits(hidden[:, -1:])  # the stage's forward gathered the head (ZeRO-3)
        logits = head.full_logits(last)[:, 0].float().contiguous()  # the broadcast needs it whole
    if pmodel.pcfg.pp > 1:
        dist.broadcast(logits, group=pmodel.mesh.get_group("pp"), group_src=pmodel.stage_owners[-1])
    return logits


def _check_prompts(pmodel, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        shape = tuple(input_ids.shape)
        raise ValueError(f"generate takes input_ids [batch, tokens] with at least one row, got {shape}")
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0])
        raise ValueError(f"prompt {row} is empty: every prompt needs at least one token")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("prompts must be padded on the left (tokenizer.padding_side = 'left'), as for stock generate")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    window = getattr(pmodel.config, "max_position_embeddings", None)
    longest = int(lengths.max())
    if window is not None and longest >= window:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room in the model's window of {window} tokens "
            "(max_position_embeddings): shorten the prompt"
        )
    if window is not None and longest + max_new_tokens > window:
        raise ValueError(
            f"{max_new_tokens} new tokens after a prompt of {longest} tokens pass the model's window of {window} "
            f"tokens (max_position_embeddings): lower max_new_tokens to at most {window - longest}"
        )


def _stopping(gen, tokenizer, prompt_length: int, max_length: int):
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        StoppingCriteriaList,
    )

    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=max_length)])
    if gen.eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id=gen.eos_token_id))
    if gen.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer= to generate")
        criteria.append(StopText(tokenizer, gen.stop_strings, prompt_length))
    return criteria


class StopText:
    """A row is done once the text of its new tokens holds one of the stop strings (stock's StopStringCriteria
    matches token pieces against the text's end, which assumes a tokenizer whose pieces it can clean; this
    decodes, so it takes any tokenizer)."""

    def __init__(self, tokenizer, stop_strings, prompt_length: int):
        self.tokenizer, self.prompt_length = tokenizer, prompt_length
        self.stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length :], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


def _warpers(gen):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if gen.temperature is not None and gen.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(gen.temperature))
    if gen.top_k is not None and gen.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=gen.top_k))
    if gen.top_p is not None and gen.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=gen.top_p))
    return warpers


def generation_config(pmodel, options: dict):
    """Stock's GenerationConfig of the model's folder (or of its config), updated with `options`."""
    from transformers import GenerationConfig

    gen = options.pop("generation_config", None)
    if gen is None:
        folder = pmodel.tokenizer_dir
        if folder is not None and (folder / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(folder)
        else:
            gen = GenerationConfig.from_model_config(pmodel.config)
    gen = copy.deepcopy(gen)
    unknown = gen.update(**options)
    assert not unknown, unknown
    if gen.pad_token_id is None:
        eos = gen.eos_token_id
        gen.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return gen


@torch.no_grad()
def generate(pmodel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options):
    """ParallelModel.generate. input_ids / attention_mask: this dp replica's prompts, left-padded (every tp / pp /
    cp rank of a replica passes the same rows). Options, with stock's names and defaults (from the model folder's
    generation_config.json or its config): max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
    pad_token_id, stop_strings (with tokenizer=), generation_config, output_logits, return_dict_in_generate; and
    seed, the sampling seed (needed on several processes). Greedy unless do_sample. Returns the sequences [b,
    prompt + new] (a finished row padded with pad_token_id), or with return_dict_in_generate a
    GenerateDecoderOnlyOutput (sequences, logits). Collective over the replica's ranks (and over the expert
    group's dp ranks under ep)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"generate does not take {', '.join(unknown)}; it takes {', '.join(OPTIONS)}")
    seed, tokenizer = options.pop("seed", None), options.pop("tokenizer", None)
    output_logits = bool(options.pop("output_logits", False))
    as_dict = bool(options.pop("return_dict_in_generate", False))
    options.pop("use_cache", None)  # always cached
    gen = generation_config(pmodel, options)
    max_new = options.get("max_new_tokens", gen.max_new_tokens if gen.max_new_tokens is not None else 20)
    device = pmodel.device
    input_ids = input_ids.to(device)
    mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)).long()
    _check_prompts(pmodel, input_ids, mask, max_new)
    if gen.do_sample and seed is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "do_sample on several processes needs seed=: every rank of a replica must draw the same tokens"
        )
    draws = RowDraws(input_ids, mask, seed) if gen.do_sample else None
    warpers = _warpers(gen) if gen.do_sample else None
    synced = pmodel.lockstep and pmodel.dp_size > 1
    extra = (-input_ids.shape[1]) % (2 * pmodel.cp.size) if pmodel.cp.active else 0  # the prefill cuts into 2*cp
    if extra:  # more left padding, taken off again below
        input_ids = torch.cat([input_ids.new_full((input_ids.shape[0], extra), gen.pad_token_id), input_ids], dim=1)
        mask = torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)
    stopping = _stopping(gen, tokenizer, input_ids.shape[1], input_ids.shape[1] + max_new)
    was_training = pmodel.training
    pmodel.eval()
    try:
        with plain_tensor_parallel(pmodel):
            sequences, logits = _decode(pmodel, input_ids, mask, gen, warpers, stopping, draws, synced)
    finally:
        pmodel.train(was_training)
    sequences = sequences[:, extra:]
    if not as_dict:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=sequences, logits=tuple(logits) if output_logits else None)


def _decode(pmodel, ids, mask, gen, warpers, stopping, draws, synced: bool):
    """The prefill and the steps; returns (sequences [b, s + new], the raw logits of each step)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=pmodel.config)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    sequences, step_ids, all_logits = ids, ids, []
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    while True:
        if step_ids is ids and pmodel.cp.active:
            prefill = SplitPrefill()
            logits = next_logits(pmodel, ids, positions, prefill)
            prefill.fill(cache, pmodel.cp)
        else:
            logits = next_logits(pmodel, step_ids, positions, Step(cache, mask))
        if bool(unfinished.any()):  # a row group that has finished only keeps the expert group's pace
            all_logits.append(logits)
            if warpers is None:
                tokens = logits.argmax(-1)
            else:
                probs = torch.softmax(warpers(sequences, logits), dim=-1)
                tokens = draws.sample(probs).to(ids.device)
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, gen.pad_token_id))
            sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
            unfinished &= ~stopping(sequences, logits).to(unfinished.device)
        else:
            tokens = torch.full_like(sequences[:, -1], gen.pad_token_id)
        if _all_done(unfinished, pmodel, synced):
            return sequences, all_logits
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        positions = positions[:, -1:] + 1
        step_ids = tokens[:, None]


class RowDraws:
    """Sampling with one generator per row, seeded with (seed, the row's prompt tokens): a row draws the same
    tokens whatever the batch it is in and however the batch is split over dp, tp, pp or cp. Without a seed
    (one process only) the rows draw from torch's global generator."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, seed: int | None):
        self.rngs = None
        if seed is not None:
            rows = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
            keys = [zlib.crc32(repr((int(seed), row)).encode()) for row in rows]
            self.rngs = [torch.Generator().manual_seed(k) for k in keys]

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row [b] from probs [b, V], by the inverse of each row's cumulative distribution."""
        probs = probs.double().cpu()
        if self.rngs is None:
            u = torch.rand(probs.shape[0], dtype=torch.float64)
        else:
            u = torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in self.rngs])
        cdf = probs.cumsum(-1)
        picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
        return picks.clamp(max=probs.shape[-1] - 1)


def _all_done(unfinished: torch.Tensor, pmodel, synced: bool) -> bool:
    """Every row has finished (under expert parallelism or ZeRO-3: every row of every dp rank)."""
    left = unfinished.any().to(torch.int32)
    if synced:
        dist.all_reduce(left, op=dist.ReduceOp.MAX, group=pmodel.mesh.get_group("dp"))
    return not bool(left)


def new_tokens(row: torch.Tensor, eos) -> list[int]:
    """A row's generated ids up to and with its first EOS (the padding after it left out)."""
    ids = row.tolist()
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids
