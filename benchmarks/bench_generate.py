"""Decoding at the mesh (ParallelModel.generate) against stock transformers' `generate`, fp32, sdpa.

Three rows, each side by side in the same processes, medians over the rounds (the slowest rank's):
- tp1: time per decoded token of hf3d's `generate` and of stock `generate` (its default DynamicCache) on the
  same model, prompts and greedy settings, alternating (target: hf3d ≤ 1.2x stock);
- tp2 against tp1 on a wide model (hidden 2048), hf3d alone: time per decoded token (target: tp2 below tp1);
- cp2 against cp1: the prefill of one long prompt (generate with one new token) per prompt token (target: cp2
  no slower than cp1).
One process uses both cores (torch's threads); two processes one core each.

    python benchmarks/bench_generate.py            # ~4 min on 2 cores
    python benchmarks/bench_generate.py --quick    # smoke; results/quick/
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common as C
import torch

TARGET_STOCK, BATCH = 1.2, 4


def _prompts(vocab: int, rows: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for r in range(rows):  # different lengths, left-padded
        mask[r, : r * 3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _timed(fn) -> float:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(model_dir: str, row: str, mesh: str, rounds: int, new: int, prompt_len: int, out: str) -> None:
    hf3d = C.import_hf3d()
    kw = {"tp2": dict(tp=2), "cp2": dict(cp=2)}.get(mesh, {})
    pm = hf3d.parallelize(model_dir, hf3d.ParallelConfig(**kw), attn_implementation="sdpa")
    vocab = pm.config.vocab_size
    times: dict[str, list[float]] = {"hf3d": [], "stock": []}
    if row == "prefill":
        ids, mask = _prompts(vocab, 1, prompt_len)
        run = {"hf3d": lambda: pm.generate(ids, mask, max_new_tokens=1, pad_token_id=0)}
        per = prompt_len
    else:
        ids, mask = _prompts(vocab, BATCH, prompt_len)
        run = {"hf3d": lambda: pm.generate(ids, mask, max_new_tokens=new, pad_token_id=0, eos_token_id=None)}
        per = BATCH * new
        if mesh == "tp1":
            from transformers import AutoModelForCausalLM

            stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
            stock.eval()
            with torch.no_grad():
                run["stock"] = lambda: stock.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                                      pad_token_id=0, eos_token_id=None)  # fmt: skip
    for fn in run.values():
        fn()  # warm-up
    for r in range(rounds):
        for name in sorted(run, reverse=r % 2 == 1):
            with torch.no_grad():
                times[name].append(_timed(run[name]) / per)
    C.write_rank(out, {"times": {k: v for k, v in times.items() if v}})


def _median_slowest(ranks: list[dict], side: str) -> float:
    rounds = len(ranks[0]["times"][side])
    return C.median([max(r["times"][side][i] for r in ranks) for i in range(rounds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes, 1 round: a smoke run")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        m, row, mesh, r, new, plen = args.worker
        return worker(m, row, mesh, int(r), int(new), int(plen), args.out)
    rounds = 1 if args.quick else args.rounds
    narrow = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4)
    shapes = {  # row -> (config, new tokens, prompt tokens, meshes)
        "decode": (narrow, 32, 24, ["tp1"]),
        "wide": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4), 16, 24, ["tp1", "tp2"]),
        "prefill": (narrow, 1, 2048, ["tp1", "cp2"]),
    }
    if args.quick:
        small = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
        shapes = {k: ({**c, **small}, min(n, 4), min(p, 64), m) for k, (c, n, p, m) in shapes.items()}
    data = {"env": C.env_info(), "rounds": rounds, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as work:
        for row, (shape, new, plen, meshes) in shapes.items():
            cfg = C.llama_config(
                **shape, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192, max_position_embeddings=4096
            )
            model = Path(work) / row
            params = C.save_model_dir(cfg, model, dtype=torch.float32)
            entry = data["rows"][row] = {"model": C.shape_str(cfg), "params": params, "new": new, "prompt": plen}
            for mesh in meshes:
                kind = "prefill" if row == "prefill" else "decode"
                argv = ["--worker", str(model), kind, mesh, str(rounds), str(new), str(plen)]
                ranks = C.run_workers(Path(__file__), 2 if mesh in ("tp2", "cp2") else 1, argv, Path(work) / row)
                for side in ranks[0]["times"]:
                    entry[f"{mesh} {side}"] = _median_slowest(ranks, side)
    d = data["rows"]
    dec, wide, pre = d["decode"], d["wide"], d["prefill"]
    ratios = {
        "tp1_over_stock": dec["tp1 hf3d"] / dec["tp1 stock"],
        "tp2_over_tp1": wide["tp2 hf3d"] / wide["tp1 hf3d"],
        "cp2_over_cp1_prefill": pre["cp2 hf3d"] / pre["tp1 hf3d"],
    }
    data["ratios"] = ratios
    below = "met" if ratios["tp2_over_tp1"] < 1 else "missed"
    table = [
        ["decode, tp1: hf3d / stock generate", dec, "tp1 stock", "tp1 hf3d", "tp1_over_stock",
         C.verdict(ratios["tp1_over_stock"], TARGET_STOCK)],
        ["decode, wide model: hf3d tp2 / tp1", wide, "tp1 hf3d", "tp2 hf3d", "tp2_over_tp1", f"target < 1.0x: {below}"],
        ["prefill of one prompt, hf3d cp2 / cp1", pre, "tp1 hf3d", "cp2 hf3d", "cp2_over_cp1_prefill",
         C.verdict(ratios["cp2_over_cp1_prefill"], 1.0)],
    ]  # fmt: skip
    rows = [
        [what, e["model"], f"{e[base] * 1e3:.3f}", f"{e[ours] * 1e3:.3f}", f"{ratios[key]:.3f}x ({verdict})"]
        for what, e, base, ours, key, verdict in table
    ]
    body = (
        f"Greedy, fp32, sdpa; {BATCH} left-padded prompts of up to {dec['prompt']} tokens (decode rows), one prompt "
        f"of {pre['prompt']} tokens (prefill); ms per token (decoded, or of the prompt), medians over {rounds} "
        "round(s) of the slowest rank; 1 process on 2 threads, 2 processes on 1 thread each.\n\n"
        + C.md_table(["row", "model", "baseline ms / token", "hf3d ms / token", "ratio"], rows)
    )
    print(body)
    print(f"\nwrote {C.write_results('generate', 'Generation at the mesh', body, data, quick=args.quick)}")


if __name__ == "__main__":
    main()
