"""Downstream scoring against a plain forward of the same tokens, at each mesh (hf3d/evaluation).

One model (a Llama of 19M parameters, fp32, initialised from its config, the shipped BPE tokenizer), the two
tasks hf3d ships, rows of 512 tokens, 16 rows per forward. At each mesh (tp1 on one process; tp2 and pp2 on
two) every rank builds the model once and, in the same processes, alternates over the rounds:
- scoring: `Evaluator.run()` over both tasks (the contexts shared by their choices, as trees);
- a plain forward: `pmodel(input_ids=rows)` in eval mode, no grad, on rows holding exactly the tokens the
  scoring's packed units hold, with no padding and no document mask (the cheapest attention there is);
and reports the median of each and their ratio (target: scoring ≤ 1.3x the plain forward). Beside it: the
tokens a pair-by-pair packing would compute (each choice with its own copy of the context) and the padding
left at the rows' ends.

    python benchmarks/bench_eval.py            # ~3 min on 2 cores
    python benchmarks/bench_eval.py --quick    # smoke: 2 layers, 1 round, 40 rows a task; results/quick/
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common as C
import torch

TARGET = 1.3
MESHES = {"tp1": (1, dict()), "tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2, num_microbatches=2))}
TASKS = ["shakespeare-next-line", "shakespeare-word"]
ROW_LEN, ROWS = 512, 16


def worker(model_dir: str, mesh: str, rounds: int, limit: int, out: str) -> None:
    hf3d = C.import_hf3d()
    from transformers import AutoTokenizer

    from hf3d.evaluation.config import TaskEvalConfig
    from hf3d.evaluation.evaluator import Evaluator, load_tasks
    from hf3d.evaluation.requests import units_of

    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**MESHES[mesh][1]), attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = TaskEvalConfig(tasks=TASKS, limit=limit, max_length=ROW_LEN, batch_rows=ROWS)
    evaluator = Evaluator(pm, load_tasks(cfg), tok, cfg)
    batches = [b for p in evaluator.prepared.values() for b in p.batches]
    tokens = sum(b.tokens for b in batches)
    computed = sum(b.input_ids.numel() for b in batches)
    pair_tokens = sum(  # every choice with its own copy of its context
        u.length
        for p in evaluator.prepared.values()
        for ex in p.examples[p.lo : p.hi]
        for u in units_of(ex, 0, window=ROW_LEN, share=False)
    )
    ids = torch.randint(
        0, pm.config.vocab_size, (tokens // ROW_LEN + 1, ROW_LEN), generator=torch.Generator().manual_seed(0)
    )
    plain = [ids[i : i + ROWS] for i in range(0, len(ids), ROWS)]
    pm.eval()

    def forward() -> None:
        with torch.no_grad():
            for rows in plain:
                pm(input_ids=rows)

    times = {"score": [], "forward": []}
    evaluator.run(progress=False)  # warm-up of both
    forward()
    for r in range(rounds):
        for name in ("score", "forward") if r % 2 == 0 else ("forward", "score"):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            evaluator.run(progress=False) if name == "score" else forward()
            times[name].append(time.perf_counter() - t0)
    rec = dict(times=times, tokens=tokens, computed=computed, pair_tokens=pair_tokens, plain_rows=len(ids))
    C.write_rank(out, rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="2 layers, 1 round, 40 rows a task: a smoke run")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MESH", "ROUNDS", "LIMIT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        m, mesh, r, limit = args.worker
        return worker(m, mesh, int(r), int(limit), args.out)
    layers, rounds, limit = (2, 1, 40) if args.quick else (4, args.rounds, 300)
    cfg = C.llama_config(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=2000, max_position_embeddings=1024,
    )  # fmt: skip
    data, rows = {"env": C.env_info(), "model": C.shape_str(cfg), "rounds": rounds, "meshes": {}}, []
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as work:
        model = Path(work) / "model"
        data["params"] = C.save_model_dir(cfg, model, dtype=torch.float32)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(C.REPO / "examples" / "tokenizer").save_pretrained(model)
        for mesh, (nproc, _) in MESHES.items():
            ranks = C.run_workers(Path(__file__), nproc, ["--worker", str(model), mesh, str(rounds), str(limit)],
                                  Path(work) / mesh)  # fmt: skip
            score = C.median([max(r["times"]["score"][i] for r in ranks) for i in range(rounds)])
            forward = C.median([max(r["times"]["forward"][i] for r in ranks) for i in range(rounds)])
            r0 = ranks[0]
            m = dict(score_s=score, forward_s=forward, ratio=score / forward, **{k: r0[k] for k in r0 if k != "times"})
            data["meshes"][mesh] = m
            rows.append(
                [
                    mesh,
                    f"{m['tokens']:,}",
                    f"{m['pair_tokens'] / m['tokens']:.2f}x",
                    f"{1 - m['tokens'] / m['computed']:.1%}",
                    score,
                    forward,
                    f"{m['ratio']:.2f}x ({C.verdict(m['ratio'], TARGET)})",
                ]
            )
    headers = [
        "mesh",
        "tokens scored",
        "pair-by-pair packing would compute",
        "padding in the rows",
        "scoring s",
        "plain forward s",
        "scoring / plain forward",
    ]
    body = (
        f"Model: {data['model']} ({data['params'] / 1e6:.1f}M params, fp32, sdpa); tasks {', '.join(TASKS)} "
        f"({limit} rows each), rows of {ROW_LEN} tokens, {ROWS} rows per forward; medians over {rounds} round(s) "
        f"of the slowest rank. Target: scoring ≤ {TARGET}x a plain forward of the same unpadded tokens.\n\n"
        + C.md_table(headers, rows)
    )
    print(body)
    print(f"\nwrote {C.write_results('eval', 'Downstream scoring cost', body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
