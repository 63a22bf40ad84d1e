"""The end of a run: the loss curve, the HF export with its record and curve inside, a sample through stock
transformers, and the Hub push; the run's record that a model card is made from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..checkpoint.marker import is_complete
from ..checkpoint.untrusted import load_small
from ..hf.hub import SUMMARY_FILE
from ..utils import files
from .config import TrainConfig


def finish_run(cfg: TrainConfig, pmodel, out: Path, metrics_path: Path, last: dict, rank0: bool) -> None:
    """The loss curve, the HF export with its record and card inputs, a sample, and the Hub upload."""
    from tqdm.auto import tqdm

    from .plots import plot_loss_curve

    curve = None
    if rank0:
        stages = [(s.start_step, s.name) for s in cfg.data.resolved_stages()]
        curve = plot_loss_curve(metrics_path, out / "loss_curve.png", title=run_name(out), stages=stages)
        tqdm.write(f"hf3d: loss curve {curve}" if curve else "hf3d: no loss curve (pip install matplotlib)")
    if not cfg.run.save_final:
        return
    final = out / "final"
    record = {}  # the curve and the run's record go in with the weights: the folder appears complete
    if rank0:
        record[SUMMARY_FILE] = json.dumps(training_summary(cfg, metrics_path, last), indent=1).encode()
        if curve:
            record[curve.name] = curve.read_bytes()
    pmodel.save_pretrained(final, extra_files=record)
    if rank0:
        tqdm.write(f"hf3d: wrote {final} (load it with AutoModelForCausalLM.from_pretrained)")
        if cfg.run.sample_prompt:
            text = _sample(final, cfg.run.sample_prompt)
            files.write_file(out / "sample.txt", text + "\n", replace=True)
            tqdm.write(f"hf3d: sample from {final}:\n{text}")
    if cfg.export.push_to_hub:
        _push_final(cfg, final)


def run_name(out: Path) -> str:
    """The name a run goes by in its loss curve: its output folder's."""
    return out.resolve().name


def _sample(model_dir: Path, prompt: str, max_new_tokens: int = 48) -> str:
    """A short sample of the exported model, through stock transformers (what a user of the export gets)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.random.fork_rng(devices=[]):  # the same sample for the same weights; the run's RNG untouched
        torch.manual_seed(0)
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=50, pad_token_id=tok.eos_token_id
        )
    text = tok.decode(out[0], skip_special_tokens=True)
    return text


def training_summary(cfg: TrainConfig, metrics_path: Path, last: dict) -> dict:
    """The run's record (hf3d_training.json beside the exported weights; also in each checkpoint's extra,
    which `hf3d convert to-hf` writes out): the model card is made from it (hf3d/hf/hub.py)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.is_file() else []
    curve = [[rec["step"], rec["loss"]] for rec in records]
    evals = [rec["eval_loss"] for rec in records if "eval_loss" in rec]
    base_model, started_from = starting_point(cfg.model.path)
    base_model = cfg.export.base_model or base_model  # the user's word for a local folder that records none
    sources = sorted({s.label for stage in cfg.data.resolved_stages() for s in stage.sources})
    sources += [name for name in cfg.export.datasets if name not in sources]
    hyper = {k: v for k, v in dataclasses.asdict(cfg.optim).items() if k != "bucket_size"}
    summary = {
        "base_model": base_model,
        "started_from": started_from,
        "datasets": sources,
        "license": cfg.export.license,
        "hyperparameters": {
            **hyper,
            "steps": cfg.run.steps,
            "global_batch": cfg.run.global_batch,
            "seq_len": cfg.data.resolved_stages()[-1].seq_len,
            "document_masking": cfg.data.document_masking,
            "dtype": cfg.model.dtype,
        },
        "parallel": {k: getattr(cfg.parallel, k) for k in ("tp", "pp", "dp", "pp_schedule", "num_microbatches")},
        "tokens_seen": records[-1].get("consumed_tokens", 0) if records else 0,
        "final_loss": curve[-1][1] if curve else last.get("loss"),
        "loss_curve": curve,
    }
    if evals:
        summary["final_eval_loss"] = evals[-1]
    scored = [rec for rec in records if any(k.startswith("downstream/") for k in rec)]
    if scored:  # the last downstream evaluation: {task: {metric: score}}, the macro average as "average"
        summary["downstream"] = {"step": scored[-1]["step"]}
        for key, value in scored[-1].items():
            if key.startswith("downstream/"):
                _, task, metric = key.split("/")
                summary["downstream"].setdefault(task, {})[metric] = value
    return summary


def starting_point(model_path: str) -> tuple[str | None, str | None]:
    """(the Hub id the weights descend from, or None; the local folder's name they were loaded from, or
    None). A local folder's own record names its Hub origin: an export's hf3d_training.json, a
    checkpoint's training summary, or config.json's `_name_or_path` when it is a Hub id."""
    path = Path(model_path)
    if not path.exists():
        return (model_path if model_path.count("/") == 1 else None), None
    if not (path / "model.safetensors").is_file() and not is_complete(path) and not any(path.glob("*.safetensors")):
        return None, None  # a config-only folder: initialised from scratch
    recorded: dict = {}
    if (path / SUMMARY_FILE).is_file():
        recorded = json.loads((path / SUMMARY_FILE).read_text())
    elif (path / "extra.pt").is_file():
        recorded = load_small(path, "extra.pt").get("training") or {}
    base = recorded.get("base_model")
    if base is None and (path / "config.json").is_file():
        name = json.loads((path / "config.json").read_text()).get("_name_or_path")
        base = name if isinstance(name, str) and name.count("/") == 1 and not Path(name).exists() else None
    return base, path.resolve().name


def _push_final(cfg: TrainConfig, final: Path) -> None:
    """Rank 0 uploads; a failure is raised on every rank (no rank is left waiting)."""
    from ..hf.hub import push_to_hub
    from ..parallel.mesh import on_rank0

    def push() -> None:
        url = push_to_hub(final, cfg.export.push_to_hub, private=cfg.export.private)
        print(f"hf3d: pushed {final} to {url}")

    on_rank0(push)
