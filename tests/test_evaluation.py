"""Downstream evaluation (hf3d/evaluation) against stock transformers, fp32, gloo.

- Exactness: every choice's summed log-likelihood that hf3d's Evaluator computes at a mesh equals an
  independent stock reference (the plain stock model on `context + continuation[:-1]` alone, log_softmax
  gathered over the continuation tokens and summed) within SCORE_RTOL, and every prediction (acc, acc_norm,
  acc_norm_token) is the reference's, on tiny Llama, Qwen3, SmolLM3 (sliding-window layers) and Qwen3-MoE at
  tp2, tp2 + sequence parallel, pp2 under 1f1b and interleaved-1f1b, dp2, cp2, ep2, tp2 x pp2 (world 4), with
  and without shared contexts, eager as well as sdpa, and from a checkpoint trained a step at tp2 and read at
  pp2; `hf3d eval` under torchrun on that checkpoint at dp2 writes the same scores into its contract files.
  The rows are a synthetic task of word tokens (queries up to 40 tokens, 2-5 choices of 1-6 tokens) scored
  with a 24-token window: contexts are cut from the left, units split over rows and rows over batches.
- The formulation, rule by rule against hand-computed values: the trailing whitespace, the pairwise and the
  joint rules (a choice fused with the context's last word, lighteval's last-token rule, a pair that encodes
  shorter than its context), lighteval's left cut, the empty context, each normalisation, bits per byte, a task
  of groups, the few-shot context, and the layout of a packed row.
- Bits per byte and the lettered formulation on the shipped tasks (and rows of fused, accented choices) against
  plain transformers on rows built here from the files.
- The harness-style Hub mappings on rows written in each dataset's own fields (lighteval's strings:
  tests/test_eval_prompts.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist import report, spawn, start_watchdog
from models import VOCAB, make_model_dir, trained_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hf3d
from hf3d.evaluation import hub_tasks
from hf3d.evaluation.config import TaskEvalConfig
from hf3d.evaluation.evaluator import Evaluator, load_tasks
from hf3d.evaluation.metrics import predictions, task_result
from hf3d.evaluation.packing import make_batches
from hf3d.evaluation.requests import Unit, encode_examples, units_of
from hf3d.evaluation.tasks import FEWSHOT_SEPARATOR, Row, Task, context_of

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(2, VOCAB)]  # token ids 2..100; 0 is <eos>, 1 <unk>
WINDOW = 24  # tokens one choice reads: most contexts are cut, the longest units split over rows
ROWS = 30
GEN_ROWS, GEN_NEW, GEN_STOP = 7, 8, "w7"  # generative rows, tokens per answer, a stop string (it cuts "w76 ...")
# ~10-20x the largest relative error measured over every job of this file (fp32, gloo, 2-core CPU)
SCORE_RTOL = 2e-6  # summed log-likelihood of a choice, relative; measured 1.3e-7 (smollm3 tp2)
FP8_RTOL = 0.05  # fp8 (e4m3, tensorwise) scores against stock's fp32, relative; measured 3.6e-3 (fp8 rounding)
WATCHDOG_S = 400


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word (w2 .. w100), no special tokens added: ids a test can write."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1, **{w: i for i, w in enumerate(WORDS, start=2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def synthetic_rows(n: int, seed: int) -> list[dict]:
    g = random.Random(seed)
    words = lambda lo, hi: " ".join(g.choice(WORDS) for _ in range(g.randint(lo, hi)))
    rows = []
    for i in range(n):
        k = g.randint(2, 5)
        query = "" if i == 3 else words(1, 40) + (" " if i % 5 == 0 else "")  # an empty context; trailing spaces
        rows.append({"query": query, "choices": [" " + words(1, 6) for _ in range(k)], "gold": g.randrange(k)})
    return rows


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Model folders (with the word tokenizer saved beside the weights) and the task file."""
    root = tmp_path_factory.mktemp("evaluation")
    tok = word_tokenizer()
    dirs = {}
    for family, kw in (("llama", dict(num_hidden_layers=4)), ("qwen3", {}), ("smollm3", {}), ("qwen3-moe", {})):
        dirs[family] = make_model_dir(root / family, family, **kw)
        tok.save_pretrained(dirs[family])
    task = root / "synthetic.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows(ROWS, seed=0)))
    answers = root / "answers.jsonl"  # a generative task: {query, answer}
    rows = [{"query": r["query"], "answer": r["choices"][r["gold"]]} for r in synthetic_rows(GEN_ROWS, seed=3)]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "dirs": dirs, "task": task, "answers": answers}


def _cfg(env, **kw) -> TaskEvalConfig:
    return TaskEvalConfig(
        **{"tasks": [str(env["task"])], "max_length": WINDOW, "batch_rows": 3, "log_samples": True, **kw}
    )


def _record(results) -> dict:
    (r,) = results.tasks
    return {
        "n": r.n,
        "cut": r.cut,
        "logprobs": [s["choices_logprob"] for s in r.samples],
        "preds": [(s["pred"], s["pred_norm"], s["pred_norm_token"]) for s in r.samples],
        "scores": r.scores,
    }


# ------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------
JOBS2 = {  # name -> (family, ParallelConfig kwargs, attention, shared contexts)
    "llama/tp2": ("llama", dict(tp=2), "sdpa", True),
    "llama/tp2-sp": ("llama", dict(tp=2, sequence_parallel=True), "sdpa", True),
    "llama/pp2-1f1b": ("llama", dict(pp=2, pp_schedule="1f1b", num_microbatches=2), "sdpa", True),
    "llama/pp2-interleaved": ("llama", dict(pp=2, pp_schedule="interleaved-1f1b", num_microbatches=2), "sdpa", True),
    "llama/dp2": ("llama", dict(dp=2), "sdpa", True),
    "llama/dp2-pairs": ("llama", dict(dp=2), "sdpa", False),
    "llama/cp2": ("llama", dict(cp=2), "sdpa", True),
    "llama/tp2-eager": ("llama", dict(tp=2), "eager", True),
    "qwen3/tp2-sp": ("qwen3", dict(tp=2, sequence_parallel=True), "sdpa", True),
    "qwen3/pp2-1f1b": ("qwen3", dict(pp=2, pp_schedule="1f1b", num_microbatches=2), "sdpa", True),
    "qwen3/dp2": ("qwen3", dict(dp=2), "sdpa", True),
    "qwen3/cp2": ("qwen3", dict(cp=2), "sdpa", True),
    "smollm3/tp2": ("smollm3", dict(tp=2), "sdpa", True),
    "smollm3/cp2-pairs": ("smollm3", dict(cp=2), "sdpa", False),
    "qwen3-moe/dp2-ep2": ("qwen3-moe", dict(dp=2, ep=2), "sdpa", True),
    "qwen3-moe/tp2": ("qwen3-moe", dict(tp=2), "sdpa", True),
    "qwen3-moe/pp2-1f1b": ("qwen3-moe", dict(pp=2, pp_schedule="1f1b", num_microbatches=2), "sdpa", True),
}
GENERATIVE_MESHES = {"tp2": dict(tp=2), "dp2": dict(dp=2), "pp2": dict(pp=2, num_microbatches=2), "cp2": dict(cp=2)}
JOBS4 = {"llama/tp2-pp2-sp": ("llama", dict(tp=2, pp=2, sequence_parallel=True, num_microbatches=2), "sdpa", True)}


def _score(env, path, pcfg_kw: dict, attn: str, share: bool) -> dict:
    pm = hf3d.parallelize(path, hf3d.ParallelConfig(**pcfg_kw), attn_implementation=attn)
    evaluator = Evaluator(pm, load_tasks(_cfg(env)), word_tokenizer(), _cfg(env), share_context=share)
    return _record(evaluator.run(progress=False))


def _checkpoint_job(env) -> dict:
    """A step of AdamW at tp2, saved as a checkpoint and exported; the checkpoint read at pp2 and scored."""
    from hf3d.model_source import load_model

    trained_checkpoint(env["dirs"]["llama"], env["root"])
    pm2 = load_model(
        str(env["root"] / "ckpt"), hf3d.ParallelConfig(pp=2), dtype=torch.float32, attn_implementation="sdpa"
    )
    return _record(Evaluator(pm2, load_tasks(_cfg(env)), word_tokenizer(), _cfg(env)).run(progress=False))


def _compiled_job(env) -> dict:
    """Compiled layers (aot_eager: dynamo's guards without a C++ compile) at tp2, as `hf3d train` runs them:
    scoring rows shaped as a training micro-batch, an evaluation before training and between steps. Returns
    the first evaluation's scores and dynamo's graph count after each phase."""
    import importlib

    from torch._dynamo.utils import counters

    par = importlib.import_module("hf3d.parallelize")  # the module (hf3d.parallelize is the function)
    counters.clear()
    compile_layers = par.compile_layers
    par.compile_layers = lambda layers: [layer.compile(backend="aot_eager") for layer in layers]
    try:
        pm = hf3d.parallelize(str(env["dirs"]["llama"]), hf3d.ParallelConfig(tp=2, compile=True, num_microbatches=2))
    finally:
        par.compile_layers = compile_layers
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    rows = 3  # a micro-batch: 6 rows of WINDOW tokens in 2 micro-batches
    evaluator = Evaluator(pm, load_tasks(_cfg(env)), word_tokenizer(), _cfg(env, batch_rows=None), default_rows=rows)
    ids = torch.randint(2, VOCAB, (2 * rows, WINDOW), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(WINDOW).remainder(WINDOW // 2).expand(2 * rows, -1)  # packed: two documents a row

    def step():
        pm.train_step(ids, ids, position_ids=positions)
        opt.step()
        opt.zero_grad()

    graphs = lambda: counters["stats"]["unique_graphs"]
    first = _record(evaluator.run(progress=False))
    after_first_eval = graphs()
    step()
    after_training = graphs()
    evaluator.run(progress=False)
    step()
    evaluator.run(progress=False)
    return {
        **first,
        "graphs": [after_first_eval, after_training, graphs()],
        "breaks": sum(counters["graph_break"].values()),
    }


def _fp8_job(env) -> dict:
    """FP8 (tensorwise, emulated) projections at tp2: scored through the FP8 layers."""
    pm = hf3d.parallelize(
        str(env["dirs"]["llama"]), hf3d.ParallelConfig(tp=2), fp8=hf3d.FP8Config("tensorwise", emulate=True)
    )
    return _record(Evaluator(pm, load_tasks(_cfg(env)), word_tokenizer(), _cfg(env)).run(progress=False))


def _generative_job(env, pcfg_kw: dict) -> list[str]:
    """The generative task's answers (num_fewshot 1) at a mesh."""
    pm = hf3d.parallelize(str(env["dirs"]["llama"]), hf3d.ParallelConfig(**pcfg_kw))
    cfg = _gen_cfg(env)
    (result,) = Evaluator(pm, load_tasks(cfg), word_tokenizer(), cfg).run(progress=False).tasks
    return [s["generated"] for s in result.samples]


def _gen_cfg(env) -> TaskEvalConfig:
    return TaskEvalConfig(
        tasks=[str(env["answers"])], num_fewshot=1, max_length=WINDOW * 2, batch_rows=3, max_new_tokens=GEN_NEW,
        stop=[GEN_STOP], log_samples=True,
    )  # fmt: skip


def _trainer_job(env) -> dict:
    """hf3d.Trainer(eval_tasks=...).evaluate(), the accelerate path and evaluate_tasks on one model at tp2."""
    from accelerate import Accelerator
    from transformers import TrainingArguments

    pm = hf3d.parallelize(str(env["dirs"]["llama"]), hf3d.ParallelConfig(tp=2))
    args = TrainingArguments(output_dir=str(env["root"] / "trainer"), use_cpu=True, report_to="none", disable_tqdm=True)
    trainer = hf3d.Trainer(model=pm, args=args, eval_tasks=_cfg(env), processing_class=word_tokenizer())
    from_trainer = trainer.evaluate()
    acc = Accelerator(cpu=True)
    opt = hf3d.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    prepared, _ = hf3d.prepare(acc, pm, opt)
    from_accelerate = hf3d.evaluate_tasks(prepared, _cfg(env), word_tokenizer(), progress=False).metrics()
    return {"trainer": from_trainer, "accelerate": from_accelerate}


def _world(env, jobs: dict, extras: bool, out: str) -> None:
    start_watchdog(WATCHDOG_S)
    res = {name: _score(env, str(env["dirs"][f]), kw, attn, share) for name, (f, kw, attn, share) in jobs.items()}
    if extras:
        res["llama/checkpoint-tp2-to-pp2"] = _checkpoint_job(env)
        res["llama/tp2-compiled"] = _compiled_job(env)
        res["llama/tp2-fp8"] = _fp8_job(env)
        res["trainer"] = _trainer_job(env)
        res["generative"] = {mesh: _generative_job(env, kw) for mesh, kw in GENERATIVE_MESHES.items()}
    report(res, out)


@pytest.fixture(scope="module")
def world2(env) -> list[dict]:
    out = env["root"] / "world2.pt"
    spawn(_world, 2, env, JOBS2, True, str(out))
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def world4(env) -> list[dict]:
    out = env["root"] / "world4.pt"
    spawn(_world, 4, env, JOBS4, False, str(out))
    return torch.load(out, weights_only=False)


# ------------------------------------------------------------------------------------------------
# the oracle
# ------------------------------------------------------------------------------------------------
def stock_scores(model_dir: Path, env, attn: str = "sdpa") -> dict:
    """Each choice's summed log-likelihood from stock transformers, every pair on its own, and the picks."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    (task,) = load_tasks(_cfg(env))
    examples = encode_examples(
        word_tokenizer(), [r.query for r in task.rows], [r.choices for r in task.rows], window=WINDOW, where="ref"
    )
    logprobs, preds = [], []
    for row, ex in zip(task.rows, examples):
        sums = []
        for ctx, cont in zip(ex.contexts, ex.continuations):
            ids = torch.tensor([ctx + cont[:-1]])
            with torch.no_grad():
                lp = model(ids).logits[0].float().log_softmax(-1)
            picked = lp[len(ctx) - 1 :].gather(-1, torch.tensor(cont).unsqueeze(-1))
            sums.append(picked.sum().item())
        logprobs.append(sums)
        p = predictions(sums, [len(c) for c in ex.continuations], [len(c) for c in row.choices])
        preds.append((p["acc"], p["acc_norm"], p["acc_norm_token"]))
    return {"logprobs": logprobs, "preds": preds, "cut": sum(ex.cut for ex in examples)}


@pytest.fixture(scope="module")
def stock(env) -> dict:
    refs = {family: stock_scores(path, env) for family, path in env["dirs"].items()}
    refs["llama/eager"] = stock_scores(env["dirs"]["llama"], env, attn="eager")
    return refs


def _compare(got: dict, want: dict, what: str) -> float:
    assert got["n"] == len(want["logprobs"]) == ROWS, f"{what}: {got['n']} examples scored, {ROWS} in the task"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got["logprobs"], want["logprobs"])):
        assert len(g) == len(w), f"{what} row {i}: {len(g)} choices scored, {len(w)} in the row"
        for j, (a, b) in enumerate(zip(g, w)):
            rel = abs(a - b) / abs(b)
            worst = max(worst, rel)
            assert rel <= SCORE_RTOL, f"{what} row {i} choice {j}: {a!r} vs stock {b!r} (relative {rel:.2e})"
    assert got["preds"] == want["preds"], f"{what}: predictions differ from stock's"
    assert got["cut"] == want["cut"] > 0, f"{what}: {got['cut']} contexts cut, stock's rule cuts {want['cut']}"
    return worst


@pytest.mark.parametrize("job", sorted(JOBS2))
def test_scores_equal_stock_at_world2_meshes(world2, stock, job):
    family, _, attn, _ = JOBS2[job]
    want = stock["llama/eager"] if attn == "eager" else stock[family]
    for rank, res in enumerate(world2):
        _compare(res[job], want, f"{job} rank {rank}")


def test_scores_equal_stock_at_tp2_pp2(world4, stock):
    (job,) = JOBS4
    for rank, res in enumerate(world4):
        _compare(res[job], stock["llama"], f"{job} rank {rank}")


def test_a_checkpoint_saved_at_tp2_scores_at_pp2_as_stock_does_on_its_export(world2, env):
    want = stock_scores(env["root"] / "trained", env)
    untrained = stock_scores(env["dirs"]["llama"], env)
    assert want["logprobs"] != untrained["logprobs"]  # the step moved the weights: a stale read would show
    for rank, res in enumerate(world2):
        _compare(res["llama/checkpoint-tp2-to-pp2"], want, f"checkpoint rank {rank}")


def test_compiled_layers_score_as_stock_and_evaluating_compiles_nothing_after_the_first_time(world2, stock):
    """The first evaluation compiles the inference graph of the layers (no grad, eval mode); training after it,
    and every later evaluation between steps, add no graph: no recompile."""
    for rank, res in enumerate(world2):
        job = res["llama/tp2-compiled"]
        _compare(job, stock["llama"], f"compiled rank {rank}")
        # one inference graph (both layers share it, every batch has the training micro-batch's shape), then
        # one training graph, then none: neither training after an evaluation nor a later evaluation recompiles
        assert job["graphs"] == [1, 2, 2], job["graphs"]
        assert job["breaks"] == 0


def test_fp8_layers_score_within_fp8_error_of_stock(world2, stock):
    want = stock["llama"]["logprobs"]
    for res in world2:
        got = res["llama/tp2-fp8"]["logprobs"]
        rel = max(abs(a - b) / abs(b) for g, w in zip(got, want) for a, b in zip(g, w))
        assert 0 < rel <= FP8_RTOL, f"fp8 scores {rel:.2e} from stock's"


def test_the_trainer_and_the_accelerate_path_report_the_same_scores(world2, stock):
    ranks = [res["trainer"] for res in world2]
    want = stock["llama"]
    golds = [r["gold"] for r in synthetic_rows(ROWS, seed=0)]
    for i, metric in enumerate(("acc", "acc_norm", "acc_norm_token")):
        expected = sum(p[i] == g for p, g in zip(want["preds"], golds)) / ROWS
        for r in ranks:
            assert r["trainer"][f"eval_downstream/synthetic/{metric}"] == pytest.approx(expected, abs=1e-12)
            assert r["accelerate"][f"downstream/synthetic/{metric}"] == pytest.approx(expected, abs=1e-12)
            assert r["trainer"][f"eval_downstream/average/{metric}"] == r["accelerate"][f"downstream/average/{metric}"]


def test_generative_answers_are_stock_generates_at_every_mesh(world2, env):
    """Greedy answers after a few-shot context, cut at the stop string, equal stock's generate on each row alone."""
    from hf3d.evaluation.generative import cut_at_stop

    cfg, tok = _gen_cfg(env), word_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(env["dirs"]["llama"], dtype=torch.float32).eval()
    (task,) = load_tasks(cfg)
    raw, eos = [], model.generation_config.eos_token_id
    for i in range(len(task.rows)):
        ids = torch.tensor([tok(context_of(task, i, num_fewshot=1, seed=cfg.fewshot_seed))["input_ids"]])
        out = model.generate(ids, max_new_tokens=GEN_NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
        raw.append(tok.decode(out[: out.index(eos) + 1] if eos in out else out, skip_special_tokens=True))
    want = [cut_at_stop(text, [GEN_STOP]) for text in raw]
    assert any(GEN_STOP in text for text in raw) and any(want), raw  # the stop string cuts some answers, not all
    for rank, res in enumerate(world2):
        for mesh, got in res["generative"].items():
            assert got == want, f"{mesh} rank {rank}: answers differ from stock's"


def test_the_final_number_and_the_stop_strings():
    from hf3d.evaluation.generative import cut_at_stop, final_number

    assert final_number("He pays $1,234.50 in all.") == "1234.5"
    assert final_number("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert final_number("12 apples, then 3.0") == "3"
    assert final_number("-5 degrees") == "-5" and final_number("no number") is None
    assert cut_at_stop("a b\n\nQuestion: c", ["\n\n", "Question:"]) == "a b"
    assert cut_at_stop("a b", ["\n\n"]) == "a b"


def test_hf3d_eval_under_torchrun_writes_the_contract_files(world2, env, tmp_path):
    """`hf3d eval CKPT --tasks FILE,NAME --log-samples --set parallel.dp=2` at a third mesh: results.json's
    fields per task, one samples line per row in the task's order, and the scores of stock on the export."""
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hf3d", "eval"]
    cmd += [str(env["root"] / "ckpt"), "--tasks", f"{env['task']},shakespeare-word", "--limit", str(ROWS)]
    cmd += ["--output-dir", str(out), "--log-samples", "--max-length", str(WINDOW), "--set", "parallel.dp=2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "synthetic" in done.stdout and "average" in done.stdout  # the table
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {"synthetic", "shakespeare-word"}
    for name, r in results["results"].items():
        assert {"acc", "acc_norm", "acc_norm_token", "n"} <= set(r), name
    assert results["results"]["synthetic"]["n"] == ROWS
    assert results["average"]["acc"] == pytest.approx(sum(r["acc"] for r in results["results"].values()) / 2)
    want = stock_scores(env["root"] / "trained", env)
    lines = [json.loads(x) for x in (out / "samples_synthetic.jsonl").read_text().splitlines()]
    assert [s["index"] for s in lines] == list(range(ROWS))
    fields = {"choices_logprob", "choices_tokens", "choices_chars", "pred", "gold"}
    assert all(fields <= set(s) for s in lines)
    got = {
        "n": len(lines),
        "cut": results["results"]["synthetic"]["cut"],
        "logprobs": [s["choices_logprob"] for s in lines],
        "preds": [(s["pred"], s["pred_norm"], s["pred_norm_token"]) for s in lines],
    }
    _compare(got, want, "hf3d eval")
    acc = sum(s["pred"] == s["gold"] for s in lines) / ROWS
    assert results["results"]["synthetic"]["acc"] == pytest.approx(acc)
    assert (out / "samples_shakespeare-word.jsonl").is_file()


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------------
# the formulation, by hand
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe():
    return AutoTokenizer.from_pretrained(ROOT / "examples" / "tokenizer")


def _pair(tok, context: str, choice: str, window: int = 64, pairwise: bool | None = None):
    """One choice's (context, continuation) ids by `pairwise` (None: encode_examples' default)."""
    rule = {} if pairwise is None else {"pairwise": pairwise}
    (ex,) = encode_examples(tok, [context], [(choice,)], window=window, where="t", **rule)
    return ex.contexts[0], ex.continuations[0]


def test_a_trailing_space_of_the_context_moves_to_the_choice(bpe):
    """All the trailing whitespace (lighteval's rule), under both rules: "ROMEO: \n" + "hello" is scored as
    "ROMEO:" + " \nhello"."""
    assert _pair(bpe, "ROMEO: ", "hello") == (bpe.encode("ROMEO:"), bpe.encode(" hello"))  # pairwise
    assert bpe.encode("ROMEO:") == [581, 45, 37, 47, 26] and bpe.encode(" hello") == [1726, 79]
    assert _pair(bpe, "ROMEO: ", "hello", pairwise=False) == ([581, 45, 37, 47, 26], bpe.encode("ROMEO: hello")[5:])
    ctx, cont = _pair(bpe, "ROMEO: \n", "hello")
    assert ctx == bpe.encode("ROMEO:") and cont == bpe.encode(" \nhello")


def test_a_choice_that_fuses_with_the_contexts_last_word_is_split_by_each_rule(bpe):
    """ "the" + "re": pairwise encodes the two apart ("the" and "re"); joint encodes "there" and splits it at
    encode("the")'s length, so the context is the pair's own first token. Mutation: joint as the default fails
    the first lines."""
    assert TaskEvalConfig().tokenization == "pairwise"
    assert bpe.encode("the") == [692] and bpe.encode("re") == [265] and bpe.encode("there") == [84, 476]
    assert _pair(bpe, "the", "re") == _pair(bpe, "the", "re", pairwise=True) == ([692], [265])  # the default
    assert _pair(bpe, "the", "re", pairwise=False) == ([84], [476])
    # "hel" + "lo" encodes to as many tokens as "hel": joint scores the last one (lighteval's rule)
    assert bpe.encode("hel") == [258, 76] and bpe.encode("lo") == [76, 79] and bpe.encode("hello") == [258, 1744]
    assert _pair(bpe, "hel", "lo") == ([258, 76], [76, 79])
    assert _pair(bpe, "hel", "lo", pairwise=False) == ([258], [1744])


def test_a_choice_whose_pair_encodes_shorter_than_its_context_is_scored_pairwise_and_refused_joint(bpe):
    """ "I saw ge" is 4 tokens, "I saw gentleman" 3: jointly the choice has no token of its own (it crashed the
    packing with an IndexError); pairwise it is "ntleman"'s own 3 tokens after the context's 4. The scores of
    such a row are checked against plain transformers in test_bpb_and_the_lettered_formulation_on_shipped_tasks."""
    assert bpe.encode("I saw ge") == [41, 1349, 303, 69] and bpe.encode("I saw gentleman") == [41, 1349, 1507]
    assert _pair(bpe, "I saw ge", "ntleman") == ([41, 1349, 303, 69], bpe.encode("ntleman"))
    with pytest.raises(ValueError) as e:
        encode_examples(bpe, ["a", "I saw ge"], [(" b",), (" x", "ntleman")], window=64, where="task 'edge'",
                        pairwise=False)  # fmt: skip
    assert str(e.value) == (
        "task 'edge' row 1: choice 1 ('ntleman') has no token of its own: the context and the choice encode to "
        "fewer tokens than the context alone (the choice fuses with the context's last word): score the task with "
        "tokenization pairwise (the default), which encodes the choice on its own"
    )
    with pytest.raises(ValueError, match=r"^t row 0: choice 0 \(' '\) encodes to no token: it cannot be scored"):
        _pair(word_tokenizer(), "w2", " ")  # whitespace only: no token under the word tokenizer


def test_an_empty_context_starts_from_eos():
    tok = word_tokenizer()
    for pairwise in (True, False):
        assert _pair(tok, "", " w7 w8", pairwise=pairwise) == ([0], [7, 8])
        assert _pair(tok, "   ", "w7", pairwise=pairwise) == ([0], [7])


def test_a_long_context_is_cut_from_the_left_as_lighteval_cuts_and_a_long_choice_refused():
    """lighteval reads (context + continuation)[-max_length:]: the context keeps window - len(continuation)
    tokens. Mutation: the old cut (window + 1 - len(continuation), one token more) fails each cut below."""
    tok = word_tokenizer()
    context = " ".join(f"w{i}" for i in range(2, 12))  # ids 2..11
    cont = [50, 51, 52]
    for window in (8, 4, 12):
        (ex,) = encode_examples(tok, [context], [(" w50 w51 w52",)], window=window, where="t")
        kept = (list(range(2, 12)) + cont)[-window:][: -len(cont)]
        assert ex.contexts == [kept] and ex.continuations == [cont] and ex.cut == (window < 13), window
    (ex,) = encode_examples(tok, [context], [(" w50",)], window=11, where="t")
    assert ex.contexts == [list(range(2, 12))] and not ex.cut  # 10 + 1 tokens: fits
    with pytest.raises(ValueError, match=r"^t row 0: choice 0 is 3 tokens, which with one token of its context is "
                       r"more than the window of 3 tokens"):  # fmt: skip
        encode_examples(tok, [context], [(" w50 w51 w52",)], window=3, where="t")


def test_a_context_far_longer_than_the_window_is_cut_by_characters_to_the_same_ids(bpe):
    """Only the characters the window can hold are encoded (hf3d/utils/tokens.py); the ids kept are those of the
    whole context encoded and cut by tokens, in the log-likelihood and the generative paths. Mutation: keeping
    one character a token for each token drops ids the window should hold (the equality fails)."""
    from hf3d.evaluation.generative import generate_block  # noqa: F401 - the generative path's cut is the same call
    from hf3d.utils.tokens import chars_for, cut_left

    lines = [json.loads(line)["text"] for line in (ROOT / "examples" / "data" / "shakespeare.jsonl").open()][:400]
    context = "\n".join(lines) + "\nROMEO: "
    assert len(context) > 20 * chars_for(64, bpe)  # the cut happens, far from the window
    whole_ctx = bpe(context.rstrip())["input_ids"]
    for pairwise in (True, False):
        (ex,) = encode_examples(bpe, [context], [("hello there", "friend")], window=64, where="t", pairwise=pairwise)
        for choice, ctx, cont in zip(("hello there", "friend"), ex.contexts, ex.continuations):
            # the trailing space moves to the choice
            whole = bpe(context.rstrip() + " " + choice)["input_ids"]
            want = bpe(" " + choice, add_special_tokens=False)["input_ids"] if pairwise else whole[len(whole_ctx) :]
            context_ids = whole_ctx if pairwise else whole[: len(whole_ctx)]
            assert cont == want and ctx == context_ids[-(64 - len(cont)) :]
        assert ex.cut
    kept, cut = cut_left(context, 64, bpe)
    assert cut and bpe(kept)["input_ids"][-64:] == bpe(context)["input_ids"][-64:]
    from hf3d.generation.command import _refuse_long_prompts  # a prompt surely over the window: never tokenised

    _refuse_long_prompts(["x" * chars_for(64, bpe)], bpe, 64)
    with pytest.raises(ValueError, match=r"^prompt 1 is 2,715 characters, more than the model's 64 positions"):
        _refuse_long_prompts(["ROMEO:", "x" * (chars_for(64, bpe) + 1)], bpe, 64)


def test_a_line_longer_than_the_limit_is_refused_before_it_is_held(tmp_path):
    """A 120 MB line in a task file and in a prompts file: one line each, and what reading them allocates stays
    far under the file's size (tracemalloc's peak; the limit is 16 MiB). A non-UTF-8 byte and JSON nested
    100,000 deep are one line naming the line too."""
    import tracemalloc

    from hf3d.evaluation.tasks import load_task
    from hf3d.generation.command import read_prompts

    size = 120 << 20
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.write('{"query": "a b", "choices": ["c"], "gold": 0, "prompt": "p"}\n')
        f.write('{"query": "' + "x" * size + '", "prompt": "y"}\n')
    for read in (lambda: load_task(str(big)), lambda: read_prompts(None, str(big))):
        tracemalloc.start()
        with pytest.raises(ValueError) as e:
            read()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert str(e.value) == (
            f"{big} line 2 is longer than 16 MiB, the most hf3d reads as one row or prompt: shorten it (a model "
            "reads only its last max_length tokens anyway)"
        )
        assert peak < 3 * (16 << 20) < 2 * size, peak  # measured 34.1 MB: the limit read twice over, not the file
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"query": "a", "choices": ["b"], "gold": 0}\n{"query": "caf\xe9", "choices": [], "gold": 0}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl line 2 is not valid UTF-8 \(byte 0xe9 at column 15\)"):
        load_task(str(latin))
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"deep.jsonl line 1 nests JSON deeper than hf3d parses: flatten the row"):
        read_prompts(None, str(deep))


def test_each_normalisation_divides_by_its_own_length():
    # " ab": 3 characters, 1 token, -3.0; " c": 2 characters, 2 tokens, -2.5; " dddddddd": 9 characters, 3 tokens
    logprobs, tokens, chars = [-3.0, -2.5, -4.5], [1, 2, 3], [3, 2, 9]
    # acc: -2.5 is highest; per character -1.0, -1.25, -0.5; per token -3.0, -1.25, -1.5
    assert predictions(logprobs, tokens, chars) == {"acc": 1, "acc_norm": 2, "acc_norm_token": 1}
    examples = [
        {"choices_logprob": logprobs, "choices_tokens": [[1], [2, 3], [4, 5, 6]], "choices_chars": chars, "gold": 2,
         "choices_bytes": [3, 2, 9]},
        {"choices_logprob": [-1.0, -1.0], "choices_tokens": [[1], [2]], "choices_chars": [2, 2], "gold": 0,
         "choices_bytes": [3, 2]},  # a tie; " é": 2 characters, 3 bytes
    ]  # fmt: skip
    r = task_result("t", "s", examples, cut=0, num_fewshot=0)
    ln2 = 0.6931471805599453
    bpb = (4.5 / ln2 / 9 + 1.0 / ln2 / 3) / 2  # each row's gold: nats to bits, over its bytes; the mean of the rows
    assert r.scores == pytest.approx({"acc": 0.5, "acc_norm": 1.0, "acc_norm_token": 0.5, "bpb": bpb}, rel=1e-12)
    assert [e["pred_norm"] for e in r.samples] == [2, 0]


def test_a_task_of_groups_scores_the_mean_of_its_groups():
    """MMLU under lighteval's prompts: each subject a task, the score their mean (3 rows of group a, all right,
    and 1 of group b, wrong: 0.5, not 0.75). Mutation: the mean over rows fails."""
    right = {"choices_logprob": [-1.0, -2.0], "choices_tokens": [[1], [2]], "choices_chars": [2, 2], "gold": 0}
    examples = [{**right, "choices_bytes": [2, 2], "group": g} for g in ("a", "a", "a")]
    examples.append({**right, "gold": 1, "choices_bytes": [2, 4], "group": "b"})
    r = task_result("t", "s", examples, cut=0, num_fewshot=0)
    bits = lambda nats, n: nats / 0.6931471805599453 / n  # noqa: E731
    assert r.scores == pytest.approx({"acc": 0.5, "acc_norm": 0.5, "acc_norm_token": 0.5,
                                      "bpb": (bits(1.0, 2) + bits(2.0, 4)) / 2}, rel=1e-12)  # fmt: skip


def test_fewshot_contexts_are_other_rows_with_their_answers_drawn_by_seed():
    rows = [Row(f"q{i}", (" a", " b", " c"), i % 3) for i in range(6)]
    task = Task("t", rows, "s")
    ctx = context_of(task, 2, num_fewshot=2, seed=7)
    shots = ctx.split(FEWSHOT_SEPARATOR)
    assert len(shots) == 3 and shots[-1] == "q2"
    answers = {f"q{i}" + rows[i].choices[rows[i].gold] for i in range(6) if i != 2}
    assert set(shots[:2]) <= answers and shots[0] != shots[1]
    assert context_of(task, 2, num_fewshot=2, seed=7) == ctx  # the same draw on every rank and run
    assert {context_of(task, 2, num_fewshot=2, seed=s) for s in range(8)} != {ctx}  # the seed matters
    assert context_of(task, 2, num_fewshot=0, seed=7) == "q2"
    with pytest.raises(ValueError, match="num_fewshot=6 but task 't' has only 5 other rows"):
        context_of(task, 0, num_fewshot=6, seed=7)
    # lighteval's prepared queries start with a blank line: one blank line between parts, as lighteval joins them
    task = Task("t", [Row(f"\n\nQ{i}", (" a", " b"), 0) for i in range(3)], "s")
    assert context_of(task, 0, num_fewshot=2, seed=7) in ("\n\nQ1 a\n\nQ2 a\n\nQ0", "\n\nQ2 a\n\nQ1 a\n\nQ0")


def test_a_row_holds_units_as_trees_and_queries_read_the_right_columns():
    """Two units in one row of 12: [c c c | a a | b] and [d d | e], then padding."""
    first = Unit([5, 6, 7], [(0, [20, 21, 22]), (1, [30, 31])])
    second = Unit([8, 9], [(2, [40, 41])])
    (batch,) = make_batches([first, second], row_len=12, rows_per_batch=1, tree=True, pad_id=0, full_batches=False)
    assert batch.input_ids.tolist() == [[5, 6, 7, 20, 21, 30, 8, 9, 40, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2]]
    assert batch.segments.doc.tolist() == [[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]]
    assert batch.segments.branch.tolist() == [[0, 0, 0, 1, 1, 2, 0, 0, 1, 0, 0, 0]]
    queries = list(zip(batch.query_cols.tolist(), batch.query_targets.tolist(), batch.query_pairs.tolist()))
    assert queries == [(2, 20, 0), (3, 21, 0), (4, 22, 0), (2, 30, 1), (5, 31, 1), (7, 40, 2), (8, 41, 2)]
    assert batch.tokens == 9


def test_units_share_a_context_only_within_the_window():
    from hf3d.evaluation.requests import Example

    ex = Example([[1, 2, 3]] * 3, [[4, 5, 6], [7, 8], [9]], cut=False)
    assert [(u.context, [p for p, _ in u.branches]) for u in units_of(ex, 10, window=8, share=True)] == [
        ([1, 2, 3], [10, 11, 12])  # 3 + 2 + 1 + 0 = 6 positions
    ]
    assert [[p for p, _ in u.branches] for u in units_of(ex, 10, window=5, share=True)] == [[10], [11, 12]]
    assert [[p for p, _ in u.branches] for u in units_of(ex, 10, window=8, share=False)] == [[10], [11], [12]]


# ------------------------------------------------------------------------------------------------
# bits per byte and the lettered formulation on the shipped tasks, against plain transformers
# ------------------------------------------------------------------------------------------------
SHIPPED_ROWS = 24
SHIPPED_WINDOW = 64  # the lettered rows (about 50 to 90 tokens) are cut from the left, some
SHIPPED_TASKS = ["shakespeare-word", "shakespeare-word:mc", "shakespeare-next-line:mc"]
EDGE_ROWS = [  # a choice fused with the context's last word; a trailing space and letters of 2 bytes
    {"query": "I saw ge", "choices": ["ntleman", " lady"], "gold": 0},
    {"query": "Il était une fois un ", "choices": ["café", "thé crème"], "gold": 1},
]


def _shipped_job(root: str, out: str) -> None:
    """The shipped tasks (two lettered) and the edge rows, scored on one process with the embedded tokenizer."""
    start_watchdog(WATCHDOG_S)
    tasks = [*SHIPPED_TASKS, f"{root}/edge.jsonl"]
    cfg = TaskEvalConfig(tasks=tasks, limit=SHIPPED_ROWS, max_length=SHIPPED_WINDOW, batch_rows=4, log_samples=True)
    pm = hf3d.parallelize(f"{root}/bpe-llama", hf3d.ParallelConfig())
    results = Evaluator(pm, load_tasks(cfg), AutoTokenizer.from_pretrained(f"{root}/bpe-llama"), cfg).run(
        progress=False
    )
    report({r.name: (r.scores, r.cut, [s["choices_logprob"] for s in r.samples]) for r in results.tasks}, out)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, bpe) -> dict:
    root = tmp_path_factory.mktemp("shipped")
    make_model_dir(root / "bpe-llama", "llama", vocab_size=len(bpe), max_position_embeddings=128)
    bpe.save_pretrained(root / "bpe-llama")
    (root / "edge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EDGE_ROWS))
    spawn(_shipped_job, 1, str(root), str(root / "shipped.pt"))
    return {"root": root, "scores": torch.load(root / "shipped.pt", weights_only=False)[0]}


def _plain_rows(name: str, root: Path) -> list[dict]:
    """A task's rows as the docs define them, built here from the files: `:mc` lists the choices as " A. ..."
    lines after the right-stripped query and scores the letters."""
    stem, _, lettered = name.partition(":")
    path = root / "edge.jsonl" if stem == "edge" else ROOT / "hf3d" / "evaluation" / "tasks" / f"{stem}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()][:SHIPPED_ROWS]
    if not lettered:
        return rows
    letters = "ABCDEFGH"
    return [
        {
            "query": r["query"].rstrip()
            + "\n"
            + "".join(f" {letters[i]}. {c.strip()}\n" for i, c in enumerate(r["choices"]))
            + "Answer:",
            "choices": [f" {letters[i]}" for i in range(len(r["choices"]))],
            "gold": r["gold"],
        }
        for r in rows
    ]


def _plain_scores(model, tok, rows: list[dict]) -> dict:
    """lighteval 0.13.0's transformers path by hand: the context's trailing whitespace moved to the choice, the
    context encoded with special tokens and the choice without, (context + choice)[-window:] read, the choice's
    log-probabilities summed; bits per byte of the gold choice (its text with the moved whitespace), acc."""
    logprobs, bpb, hits, cut = [], [], 0, 0
    for row in rows:
        context = row["query"].rstrip()
        sums = []
        for choice in row["choices"]:
            text = row["query"][len(context) :] + choice
            ctx_ids = tok(context)["input_ids"] or [tok.eos_token_id]
            cont_ids = tok(text, add_special_tokens=False)["input_ids"]
            ids = (ctx_ids + cont_ids)[-SHIPPED_WINDOW:]
            cut += len(ctx_ids + cont_ids) > SHIPPED_WINDOW
            with torch.no_grad():
                lp = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)
            sums.append(lp[-len(cont_ids) :].gather(-1, torch.tensor(cont_ids).unsqueeze(-1)).sum().item())
            if len(sums) - 1 == row["gold"]:
                bpb.append(-sums[-1] / math.log(2) / len(text.encode("utf-8")))
        logprobs.append(sums)
        hits += max(range(len(sums)), key=lambda j: (sums[j], -j)) == row["gold"]
    return {"logprobs": logprobs, "bpb": sum(bpb) / len(bpb), "acc": hits / len(rows), "cut": cut > 0}


@pytest.mark.parametrize("name", [*SHIPPED_TASKS, "edge"])
def test_bpb_and_the_lettered_formulation_on_shipped_tasks(shipped, bpe, name):
    """Each choice's log-likelihood, acc and bits per byte (the mean over rows of the gold choice's bits over its
    UTF-8 bytes) equal plain transformers' on the rows built here from the files, pairwise, lighteval's cut.
    Mutations: characters for bytes (the edge rows), the old cut (the lettered rows), the lettered
    choices without their space, nats for bits, each fail."""
    model = AutoModelForCausalLM.from_pretrained(shipped["root"] / "bpe-llama", dtype=torch.float32).eval()
    want = _plain_scores(model, bpe, _plain_rows(name, shipped["root"]))
    scores, cut, logprobs = shipped["scores"][name]
    for i, (got_row, want_row) in enumerate(zip(logprobs, want["logprobs"], strict=True)):
        for a, b in zip(got_row, want_row, strict=True):
            assert abs(a - b) <= SCORE_RTOL * abs(b), f"{name} row {i}: {a!r} vs plain transformers' {b!r}"
    assert scores["bpb"] == pytest.approx(want["bpb"], rel=1e-6) and scores["acc"] == want["acc"]
    assert (cut > 0) == want["cut"] == name.endswith(":mc")  # the lettered rows are cut from the left


# ------------------------------------------------------------------------------------------------
# the Hub mappings
# ------------------------------------------------------------------------------------------------
HUB_LINES = {
    "hellaswag": (
        {
            "activity_label": "Baking cookies",
            "ctx_a": "A woman puts flour in a bowl. [header] She",
            "ctx_b": "then",
            "endings": ["adds eggs [title] Mix well.", "leaves."],
            "label": "0",
        },
        {
            "query": "Baking cookies: A woman puts flour in a bowl. She Then",
            "choices": [" adds eggs. Mix well.", " leaves."],
            "gold": 0,
        },
    ),
    "arc_easy": (
        {"question": "What melts ice?", "choices": {"text": ["Heat", "Cold"], "label": ["A", "B"]}, "answerKey": "A"},
        {"query": "Question: What melts ice?\nAnswer:", "choices": [" Heat", " Cold"], "gold": 0},
    ),
    "piqa": (
        {"goal": "Open a jar", "sol1": "Twist the lid", "sol2": "Shout at it", "label": 0},
        {"query": "Question: Open a jar\nAnswer:", "choices": [" Twist the lid", " Shout at it"], "gold": 0},
    ),
    "mmlu": (
        {"question": "2 + 2 =", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "math"},
        {"query": "Question: 2 + 2 =\nAnswer:", "choices": [" 3", " 4", " 5", " 6"], "gold": 1},
    ),
    "commonsense_qa": (
        {"question": "Where is salt?", "choices": {"label": ["A", "B"], "text": ["sea", "sky"]}, "answerKey": "A"},
        {"query": "Question: Where is salt?\nAnswer:", "choices": [" sea", " sky"], "gold": 0},
    ),
    "winogrande": (
        {"sentence": "The cup broke because _ was thin.", "option1": "the cup", "option2": "the table", "answer": "1"},
        {"query": "The cup broke because ", "choices": ["the cup was thin.", "the table was thin."], "gold": 0},
    ),
    "openbookqa": (
        {"question_stem": "Sun is a", "choices": {"text": ["star", "moon"], "label": ["A", "B"]}, "answerKey": "B"},
        {"query": "Question: Sun is a\nAnswer:", "choices": [" star", " moon"], "gold": 1},
    ),
    "gsm8k": (
        {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"},
        {"query": "Question: Tom has 3 apples and buys 2. How many?\nAnswer:", "answer": " 3 + 2 = 5\n#### 5"},
    ),
    "boolq": (
        {"question": "is the sky blue", "passage": "The sky is blue.", "answer": True},
        {"query": "The sky is blue.\nQuestion: is the sky blue?\nAnswer:", "choices": [" no", " yes"], "gold": 1},
    ),
}


@pytest.mark.parametrize("name", sorted(HUB_LINES))
def test_hub_mappings_write_the_harness_style_rows(name):
    """`prompt_style: harness` (SmolLM2's prompts); lighteval's strings are tests/test_eval_prompts.py's."""
    line, want = HUB_LINES[name]
    assert hub_tasks.HUB_TASKS[name].mapping("harness", False)(line) == want


def test_every_hub_task_has_a_harness_style_mapping_tested():
    tested = set(HUB_LINES) | {"arc_challenge"}  # arc_challenge: arc_easy's mapping on another subset
    assert set(hub_tasks.HUB_TASKS) == tested


def _plant_hellaswag(launch: Path) -> None:
    """Three rows under ./Rowan/hellaswag/ whose gold is the only ending: a benchmark scored from them is 1.0."""
    planted = launch / "Rowan" / "hellaswag"
    planted.mkdir(parents=True)
    row = {"activity_label": "Planted", "ctx_a": "x", "ctx_b": "y", "endings": ["z"], "label": "0"}
    (planted / "validation.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(3)))


def test_a_folder_named_like_a_hub_task_in_the_launch_folder_is_never_read(tmp_path, monkeypatch):
    """`datasets` takes ./Rowan/hellaswag/ for the Hub dataset Rowan/hellaswag; hf3d resolves Hub ids from an empty
    folder of its own. Offline with an empty cache the planted rows are refused with the Hub's line (they were
    scored before: acc 1.0). Mutation: loading from the launch folder returns the three planted rows."""
    import datasets.config
    import huggingface_hub.constants

    _plant_hellaswag(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"^task 'hellaswag' reads the Hub dataset Rowan/hellaswag, split validation"):
        hub_tasks.load_hub_task("hellaswag")
    assert Path.cwd() == tmp_path  # the launch folder is given back


def test_a_hub_task_names_its_revision_row_count_and_fingerprint(tmp_path, monkeypatch):
    """results.json's source for a Hub task: the snapshot's commit (read from the cache's path), the rows and a
    SHA-256 of the mapped rows; the rows come from the Hub's side even with a planted folder in the launch one."""
    import datasets

    commit = "0123456789abcdef0123456789abcdef01234567"
    line = HUB_LINES["hellaswag"][0]

    class Cached(list):
        cache_files = [{"filename": f"/cache/Rowan___hellaswag/default/0.0.0/{commit}/hellaswag-validation.arrow"}]

    def load_dataset(path, subset=None, split=None):  # datasets' own rule: a local path first
        return ["planted"] if os.path.exists(path) else Cached([line, line])

    _plant_hellaswag(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = hub_tasks.load_hub_task("hellaswag")
    rows = json.dumps([[r.query, list(r.choices), r.gold] for r in task.rows]).encode()
    assert task.source == (
        f"Rowan/hellaswag, split validation, lighteval 0.13.0 cloze prompts (CF), revision {commit}, 2 rows, "
        f"rows sha256 {hashlib.sha256(rows).hexdigest()[:16]}"
    )
    assert task.rows[0].query.startswith("\n\nBaking cookies:\n")


# ------------------------------------------------------------------------------------------------
# hf3d train
# ------------------------------------------------------------------------------------------------
def test_hf3d_train_scores_during_the_run_as_hf3d_eval_scores_its_checkpoint(tmp_path):
    """`evals:` every 2 steps at tp2: metrics.jsonl, the log line, evals/step_<N>/, the loss curve and the
    export's record carry the scores; `hf3d eval` on the step-4 checkpoint at pp2 gives the same scores."""
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hf3d"]
    sets = ["run.steps=4", "run.global_batch=4", "data.seq_len=32", "optim.warmup_steps=2", "run.log_every=4"]
    sets += ["checkpoint.every=2", "evals.tasks=[shakespeare-word]", "evals.every=2", "evals.limit=12"]
    sets += ["evals.log_samples=true", f"run.output_dir={out}", "run.sample_prompt=null"]
    done = subprocess.run(
        [*torchrun, "train", "examples/configs/tiny-smollm.yaml", "--set", *sets],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r["step"] for r in records if "downstream/shakespeare-word/acc_norm" in r]
    assert scored == [2, 4]
    keys = {
        f"downstream/{t}/{m}" for t in ("shakespeare-word", "average") for m in ("acc", "acc_norm", "acc_norm_token")
    }
    assert keys <= set(records[-1])
    line = next(x for x in done.stdout.splitlines() + done.stderr.splitlines() if x.startswith("step 2/4"))
    assert f"acc_norm shakespeare-word {records[1]['downstream/shakespeare-word/acc_norm']:.3f}" in line
    record = json.loads((out / "final" / "hf3d_training.json").read_text())
    assert record["downstream"]["step"] == 4
    assert record["downstream"]["shakespeare-word"]["acc"] == records[-1]["downstream/shakespeare-word/acc"]
    assert (out / "loss_curve.png").is_file()
    during = [
        json.loads(x) for x in (out / "evals" / "step_4" / "samples_shakespeare-word.jsonl").read_text().splitlines()
    ]
    assert len(during) == 12

    after = tmp_path / "after"
    cmd = [*torchrun, "eval", str(out / "checkpoints" / "step_4"), "--tasks", "shakespeare-word", "--limit", "12"]
    cmd += ["--max-length", "32", "--output-dir", str(after), "--log-samples", "--set", "parallel.pp=2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    again = [json.loads(x) for x in (after / "samples_shakespeare-word.jsonl").read_text().splitlines()]
    for a, b in zip(during, again):
        assert a["choices_tokens"] == b["choices_tokens"] and a["pred"] == b["pred"]
        for x, y in zip(a["choices_logprob"], b["choices_logprob"]):
            assert abs(x - y) <= SCORE_RTOL * abs(y), (a["index"], x, y)
    assert (
        json.loads((after / "results.json").read_text())["results"]["shakespeare-word"]["acc"]
        == (records[-1]["downstream/shakespeare-word/acc"])
    )
