"""`hf3d generate MODEL (--prompt TEXT | --prompts FILE) --max-new-tokens N [--output OUT.jsonl]`: text from a
checkpoint (any mesh), an HF folder or a Hub id, decoded at the mesh the launch gives.

The prompts are read and checked first; the model is built at this mesh (a checkpoint's weights read into it)
and its folder's tokenizer pads the prompts on the left. The prompts are split over dp in contiguous blocks,
each replica decodes its block (ParallelModel.generate), and rank 0 prints every prompt's text and writes OUT,
one line per prompt in the file's order: {"prompt", "generated_ids" (the new tokens, up to and with the EOS
that ended them), "text" (those tokens decoded, special tokens skipped)}.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch.distributed as dist

from ..utils import files
from ..utils.jsonl import json_lines

SAMPLING_FLAGS = ("temperature", "top_k", "top_p")


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """The prompts of --prompt or --prompts FILE (a JSON object with a "prompt" string per line)."""
    if (prompt is None) == (prompts_file is None):
        raise ValueError('give exactly one of --prompt TEXT and --prompts FILE (a JSON line {"prompt": ...} each)')
    if prompt is not None:
        if not prompt:
            raise ValueError("--prompt is empty: give the text to continue")
        return [prompt]
    path = Path(prompts_file)
    if not path.is_file():
        raise ValueError(f'--prompts {prompts_file} does not exist: give a JSONL file with a "prompt" per line')
    prompts = []
    for number, value in json_lines(path):
        text = value.get("prompt") if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'{path} line {number}: a line is an object with a "prompt" string')
        if not text:
            raise ValueError(f"{path} line {number}: the prompt is empty")
        prompts.append(text)
    if not prompts:
        raise ValueError(f"{path} holds no prompt")
    return prompts


def sampling_options(args) -> dict:
    """Greedy, unless a sampling option is given (then do_sample with stock's defaults for the others)."""
    options = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    sample = bool(options) or args.do_sample
    if sample and args.seed is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "sampling on several processes needs --seed: every rank of a replica must draw the same tokens"
        )
    return {"do_sample": sample, **options, **({"seed": args.seed} if args.seed is not None else {})}


def generate_texts(pmodel, tokenizer, prompts: list[str], **options) -> list[dict]:
    """Every prompt's {"prompt", "generated_ids", "text"}, in order, on every rank: the prompts split over dp in
    contiguous blocks, each replica decoding its block padded on the left. Collective over the whole mesh."""
    from .decode import new_tokens

    tok = copy.copy(tokenizer)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    d, dp = pmodel.dp_rank, pmodel.dp_size
    lo, hi = d * len(prompts) // dp, (d + 1) * len(prompts) // dp
    block = prompts[lo:hi] or (
        prompts[:1] if pmodel.lockstep else []
    )  # an expert (ZeRO-3: shard) group decodes together
    _refuse_long_prompts(prompts, tok, getattr(pmodel.config, "max_position_embeddings", None))
    records = []
    if block:
        batch = tok(block, return_tensors="pt", padding=True)
        out = pmodel.generate(
            batch["input_ids"], batch["attention_mask"], pad_token_id=tok.pad_token_id, tokenizer=tok, **options
        )
        eos = pmodel.config.eos_token_id if tok.eos_token_id is None else tok.eos_token_id
        for text, row in zip(prompts[lo:hi], out[:, batch["input_ids"].shape[1] :]):
            ids = new_tokens(row, eos)
            records.append({"prompt": text, "generated_ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
    everyone = [records]
    if dp > 1:
        everyone = [None] * dp
        dist.all_gather_object(everyone, records, group=pmodel.mesh.get_group("dp"))
    return [r for part in everyone for r in part]


def _refuse_long_prompts(prompts: list[str], tokenizer, window: int | None) -> None:
    """A prompt so long in characters that it surely holds more tokens than the model reads is refused before it
    is tokenised (which would cost about 165 times its size in memory)."""
    from ..utils.tokens import chars_for

    if window is None:
        return
    most = chars_for(window, tokenizer)
    for i, text in enumerate(prompts):
        if len(text) > most:
            raise ValueError(
                f"prompt {i} is {len(text):,} characters, more than the model's {window} positions "
                "(max_position_embeddings) can hold: shorten the prompt"
            )


def run_generate(model: str, prompts: list[str], *, pcfg, options: dict, max_new_tokens: int, output, dtype, attn,
                 stop_strings=None, state=None) -> list[dict]:  # fmt: skip
    """What `hf3d generate` does; collective over the launched processes. Returns every prompt's record."""
    from ..model_source import check_model, load_model
    from ..utils.tokens import load_tokenizer

    check_model(model)
    if output is not None:  # before the model loads: a path that cannot be written fails now, not at the end
        files.check_output(output, "--output")
    pmodel = load_model(model, pcfg, dtype=dtype, attn_implementation=attn)
    if state is not None:
        state.locate(pmodel.mesh)
    tok = load_tokenizer(pmodel.tokenizer_dir or model)
    records = generate_texts(
        pmodel, tok, prompts, max_new_tokens=max_new_tokens, stop_strings=stop_strings or None, **options
    )
    if dist.get_rank() == 0:
        for r in records:
            print(f"{r['prompt']}{r['text']}\n")
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            files.write_file(Path(output), "".join(json.dumps(r) + "\n" for r in records), replace=True)
            print(f"hf3d generate: wrote {len(records)} line(s) to {output}")
    return records
