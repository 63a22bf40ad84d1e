"""Continued pretraining of the embedded tiny SmolLM through a plain accelerate loop.

    accelerate launch --config_file examples/accelerate/cpu.yaml examples/accelerate_loop.py
    torchrun --nproc-per-node 2 examples/accelerate_loop.py

The mesh comes from the launch (HF3D_TP, HF3D_PP, HF3D_DP, HF3D_PP_SCHEDULE, HF3D_NUM_MICROBATCHES, and an
accelerate config with FSDP2, examples/accelerate/fsdp2-cpu.yaml: its zero stage and sizes; default: tensor
parallel over every process, or with FSDP2 data parallel). The model starts from the weights of a previous
`hf3d train` run when --model points at one, else from a seeded initialisation of the config.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from accelerate import Accelerator

import hf3d
from hf3d.data import DataConfig, DataPipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="examples/models/tiny-smollm")
    ap.add_argument("--data", default="examples/data/shakespeare.jsonl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=8, help="rows per dp replica per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--output-dir", default="outputs/accelerate-loop")
    args = ap.parse_args()

    acc = Accelerator(cpu=not torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = hf3d.ParallelConfig.from_env()  # HF3D_* and an FSDP2 launch config (zero stage, sizes)
    if "HF3D_TP" not in os.environ and pcfg.zero_stage < 2:  # no sharding asked for: tensor parallel over all
        pcfg = hf3d.ParallelConfig.from_env(tp=world)
    pmodel = hf3d.parallelize(args.model, pcfg)
    opt = hf3d.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)
    tokenizer = transformers.AutoTokenizer.from_pretrained(pmodel.tokenizer_dir)
    # packed windows with document masking: input_ids, shift_labels (pre-shifted), position_ids
    data = DataPipeline(
        DataConfig(path=args.data, seq_len=args.seq_len),
        tokenizer,
        global_batch=args.rows * pmodel.dp_size,  # the whole step's rows: hf3d.prepare gives each replica its own
        dp_rank=0,
        dp_size=1,
        total_steps=args.steps,
    )
    rows = [dict(zip(b, r)) for b in map(data.next_batch, range(args.steps)) for r in zip(*b.values())]
    dl = torch.utils.data.DataLoader(rows, batch_size=args.rows)
    pmodel, opt, sched, dl = hf3d.prepare(acc, pmodel, opt, sched, dl)
    p = pmodel.pcfg
    acc.print(f"mesh: tp={p.tp} pp={p.pp} dp={pmodel.dp_size} cp={p.cp}, zero_stage={p.zero_stage}")

    for step, batch in zip(range(args.steps), dl):
        out = pmodel(**batch)  # train mode + labels: the whole forward/backward schedule runs here
        acc.backward(out.loss)  # harmless: the loss is a leaf
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.print(f"step {step + 1}: loss {out.loss.item():.6f} grad_norm {opt.last_grad_norm.item():.6f}")
    acc.save_state(f"{args.output_dir}/state")  # collective, sharded: acc.load_state resumes at any mesh
    pmodel.save_pretrained(f"{args.output_dir}/final")  # a stock HF directory
    acc.print(f"wrote {args.output_dir}/final")
    # in place of acc.end_training(), which would destroy the process group before the ranks meet
    hf3d.finish()  # every rank exits together, without gloo's interpreter-teardown abort


if __name__ == "__main__":
    main()
