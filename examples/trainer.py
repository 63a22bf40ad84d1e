"""Continued pretraining of the embedded tiny SmolLM through transformers' Trainer API (hf3d.Trainer).

    torchrun --nproc-per-node 2 examples/trainer.py
    accelerate launch --multi_gpu --num_processes 2 examples/trainer.py

(on CPU, accelerate's --cpu launcher starts a single process; --multi_gpu goes through torchrun and
hf3d picks gloo when CUDA is absent). The mesh comes from the launch (HF3D_TP, HF3D_PP, HF3D_DP,
HF3D_PP_SCHEDULE, HF3D_NUM_MICROBATCHES; default: tensor parallel over every process). --rows is the
batch of one dp replica (per_device_train_batch_size). The model starts from a seeded initialisation of
the config, or from the weights of an HF directory given with --model.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from transformers import TrainingArguments

import hf3d
from hf3d.data import DataConfig, DataPipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="examples/models/tiny-smollm")
    ap.add_argument("--data", default="examples/data/shakespeare.jsonl")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=8, help="rows per dp replica per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-rows", type=int, default=32, help="rows held out for evaluate()")
    ap.add_argument("--output-dir", default="outputs/trainer")
    ap.add_argument("--resume", default=None, help="a checkpoint-N folder of an earlier run (any mesh)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = hf3d.ParallelConfig.from_env(tp=int(os.environ.get("HF3D_TP", world)))
    pmodel = hf3d.parallelize(args.model, pcfg, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(pmodel.tokenizer_dir)
    # seeded, packed windows; HF labels (the model shifts them), positions restarting at each document
    num_rows = args.steps * args.rows * pmodel.dp_size + args.eval_rows
    data = DataPipeline(
        DataConfig(path=args.data, seq_len=args.seq_len),
        tokenizer,
        global_batch=num_rows,
        dp_rank=0,
        dp_size=1,
        total_steps=1,
    )
    batch = data.next_batch(0)
    rows = [
        {"input_ids": ids, "labels": ids, "position_ids": pos}
        for ids, pos in zip(batch["input_ids"], batch["position_ids"])
    ]

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),  # else accelerate sees one process per rank on CPU
        per_device_train_batch_size=args.rows,
        per_device_eval_batch_size=args.rows,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 2),
        save_strategy="steps",
        save_steps=max(1, args.steps // 2),
        save_total_limit=2,
        report_to="none",
        seed=0,
    )
    trainer = hf3d.Trainer(
        model=pmodel,
        args=training_args,
        train_dataset=rows[args.eval_rows :],
        eval_dataset=rows[: args.eval_rows],
        data_collator=transformers.default_data_collator,  # rows are packed: nothing to pad
        processing_class=tokenizer,  # saved with the model
    )
    trainer.train(resume_from_checkpoint=args.resume)  # checkpoints: <output_dir>/checkpoint-N, any mesh resumes
    metrics = trainer.evaluate()  # eval_loss (token mean over the held-out rows) and eval_perplexity, every rank
    trainer.save_model()  # collective: a stock HF directory in output_dir
    if trainer.is_world_process_zero():
        print(f"eval_loss {metrics['eval_loss']:.4f} perplexity {metrics['eval_perplexity']:.1f}")
        print(f"wrote {args.output_dir}")
    hf3d.finish()  # every rank exits together, without gloo's interpreter-teardown abort


if __name__ == "__main__":
    main()
