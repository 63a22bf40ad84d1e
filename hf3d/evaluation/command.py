"""`hf3d eval MODEL --tasks a,b --output-dir DIR`: downstream scores of a checkpoint (any mesh), an HF folder or a
Hub id, at the mesh the launch gives, with no export.

The tasks are read and checked first (a bad file ends the run before any model work), then the model is built
at this mesh and, for an hf3d checkpoint, its weights read from the checkpoint; the tokenizer is the model
folder's (a checkpoint holds the one it was trained with). Rank 0 prints a table and writes
`DIR/samples_<task>.jsonl` (with --log-samples; a lettered task `name:mc` as `samples_name_mc.jsonl`), then
`DIR/results.json`: a folder with a results.json holds every file of its run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..model_source import check_model, load_model
from ..parallel.config import ParallelConfig
from ..utils import files
from ..utils.configfile import build_section, set_value
from .config import TaskEvalConfig
from .evaluator import EvalResults, Evaluator, load_tasks

RESULTS_FILE = "results.json"


def parallel_config(overrides: list[str]) -> ParallelConfig:
    """The mesh from `--set parallel.KEY=VALUE ...` (dp: the processes left over, as in hf3d train)."""

    values = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        section, _, name = key.partition(".")
        if not sep or section != "parallel" or not name:
            raise ValueError(
                f"--set expects parallel.KEY=VALUE (the mesh, e.g. parallel.tp=2), got {item!r}; the evaluation's "
                "own options are flags (--limit, --num-fewshot, --max-length, ...)"
            )
        values[name] = set_value(item, value)
    return build_section(ParallelConfig, values, "parallel")


def samples_file(task_name: str) -> str:
    """The samples file of a task: `samples_<task>.jsonl`, the ":" of a lettered task's name as "_"."""
    return f"samples_{task_name.replace(':', '_')}.jsonl"


def check_output_dir(output_dir: Path, tasks, log_samples: bool) -> None:
    """Before the scoring: the folder may exist (its results are replaced) or be made; each file hf3d writes there
    is a file or nothing yet, never a link (`files.check_output`)."""
    files.check_output(output_dir, "--output-dir", folder=True)
    names = [RESULTS_FILE] + ([samples_file(t.name) for t in tasks] if log_samples else [])
    for name in names:
        files.check_output(output_dir / name, "--output-dir: the file")


def run_eval(
    model: str,
    cfg: TaskEvalConfig,
    *,
    output_dir: str,
    pcfg: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    state=None,
) -> EvalResults:
    """What `hf3d eval` does; collective over the launched processes. Returns the results (every rank)."""
    from ..utils.tokens import load_tokenizer

    out = Path(output_dir)
    tasks = load_tasks(cfg)  # every file read and checked before the model is built
    check_output_dir(out, tasks, cfg.log_samples)
    check_model(model, scratch=True)
    pmodel = load_model(model, pcfg, dtype=dtype, attn_implementation=attn_implementation)
    if state is not None:
        state.locate(pmodel.mesh)
    tokenizer = load_tokenizer(pmodel.tokenizer_dir or model)
    evaluator = Evaluator(pmodel, tasks, tokenizer, cfg)
    if dist.get_rank() == 0:
        for line in evaluator.summary():
            print(f"hf3d: {line}")
    t0 = time.perf_counter()
    results = evaluator.run()
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(results.table())
        write_results(out, results, cfg, model=model, mesh=_mesh(pmodel), seconds=seconds)
        print(f"hf3d eval: wrote {out / RESULTS_FILE} ({seconds:.1f} s of scoring)")
    return results


def _mesh(pmodel) -> dict[str, int]:
    p = pmodel.pcfg
    return {"pp": p.pp, "dp": pmodel.dp_size, "cp": p.cp, "tp": p.tp, "ep": p.ep}


def write_results(out: Path, results: EvalResults, cfg: TaskEvalConfig, **run) -> None:
    """samples_<task>.jsonl (with log_samples), then results.json, each replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    for task in results.tasks if cfg.log_samples else ():
        lines = "".join(json.dumps(sample) + "\n" for sample in task.samples)
        files.write_file(out / samples_file(task.name), lines, replace=True)
    record = {**results.to_json(), **run, "config": dataclasses.asdict(cfg)}
    files.write_file(out / RESULTS_FILE, json.dumps(record, indent=1) + "\n", replace=True)
