"""Push an HF model directory to the Hugging Face Hub, with a model card made from the run's summary.

The trainer writes its summary (the dict described below) as `hf3d_training.json` next to the
exported weights; `push_to_hub` turns it into README.md when the directory has none, creates the
repo (exist_ok) and uploads every file in ONE commit. A Hub commit is atomic, and afterwards the
listing of the new revision is checked against the local files (a `.gitignore` in the repo can make
the Hub skip files silently), so a push either returns the commit URL or raises `HubError`: a
partial upload is never reported as success. `hf3d_training.json` is uploaded too: it is the
machine-readable record of the run that the card was made from.

Summary keys, all optional (a missing one leaves its part of the card out):
    base_model       Hub id the weights descend from; None when trained from scratch or not known
    started_from     name of the local folder (export or checkpoint) the run continued from, or None
    datasets         list of dataset names (the ones shaped like Hub ids go to the card metadata)
    license          default "apache-2.0"
    hyperparameters  dict, e.g. {"lr": 3e-4, "global_batch": 64, "seq_len": 2048, "steps": 1000}
    parallel         dict, e.g. {"tp": 2, "pp": 2, "dp": 1, "schedule": "1f1b"}
    tokens_seen      int
    final_loss       float or None
    final_eval_loss  float or None: the card shows it with its perplexity
    downstream       {"step": N, task: {metric: score}}: the run's last downstream evaluation, as a table
    loss_curve       list of [step, loss] pairs, may be empty

A `loss_curve.png` in the directory (hf3d.train.plots.plot_loss_curve) is shown in the card and uploaded
with the other files.

The token comes from `token=` or `huggingface_hub.get_token()` (HF_TOKEN, then the file written by
`hf auth login`). It is handed to huggingface_hub only: never printed, logged or written; a push
whose files contain it is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..utils import files as hf3d_files

logger = logging.getLogger(__name__)
T = TypeVar("T")

REQUEST_TIMEOUT_S = 120.0
"""How long a Hub request may wait for an answer, or go without moving a byte, before it fails (and is retried)."""
SUMMARY_FILE = "hf3d_training.json"
CARD_FILE = "README.md"
LOSS_CURVE_FILE = "loss_curve.png"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")  # NAME or NAMESPACE/NAME
_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".parquet", ".arrow", ".gz", ".zst", ".ds", ".bin")
_SPARK = "▁▂▃▄▅▆▇█"
_NO_TOKEN = "no Hugging Face token found: run `hf auth login`, or `export HF_TOKEN=...` with a write token"


class HubError(ValueError):
    """A push that cannot complete. A ValueError, so `hf3d push` reports it as one line and exits 1."""


def check_repo_id(repo_id: str, *, where: str = "the repo id") -> None:
    """Refuse in one line what is not a Hub repo id (NAMESPACE/NAME or NAME)."""
    if not _HUB_ID.match(repo_id):
        raise HubError(f"{where} {repo_id!r} is not a Hub repo id: use NAMESPACE/NAME, like 'my-user/my-model'")


# ------------------------------------------------------------------------------------------------
# Model card
# ------------------------------------------------------------------------------------------------
def write_model_card(model_dir: str | Path, summary: dict, *, repo_id: str | None = None) -> Path:
    """Write `model_dir/README.md` from a training summary ({} gives a minimal card); returns its path."""
    from huggingface_hub import ModelCardData

    model_dir = Path(model_dir)
    s = _check_summary(summary)
    base_model = s.get("base_model")
    hub_datasets = [d for d in s.get("datasets", []) if _is_hub_repo(d)]
    meta = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=base_model if base_model and _is_hub_repo(base_model) else None,
        datasets=hub_datasets or None,
        license=s.get("license", "apache-2.0"),
        tags=["hf3d", "text-generation"],
    )
    title = _one_line(repo_id.split("/")[-1] if repo_id else model_dir.resolve().name)
    lines = [f"---\n{meta.to_yaml()}\n---", "", f"# {title}", ""]
    arch = _architecture(model_dir)
    lines += [f"A {arch}causal language model trained with hf3d (tensor, pipeline and data parallel"]
    lines += ["training of stock transformers models). It loads with plain `transformers`:", ""]
    lines += ["```python", "from transformers import AutoModelForCausalLM", ""]
    lines += [f'model = AutoModelForCausalLM.from_pretrained("{repo_id or title}")', "```", ""]
    if not s:
        lines += ["No training summary (`hf3d_training.json`) came with this model.", ""]
    else:
        lines += _training_section(s)
    if (model_dir / LOSS_CURVE_FILE).is_file():  # the picture leads the loss-curve section, made if need be
        image = [f"![loss curve]({LOSS_CURVE_FILE})", ""]
        if "### Loss curve" in lines:
            at = lines.index("### Loss curve") + 2
            lines[at:at] = image
        else:
            lines += ["### Loss curve", "", *image]
    path = model_dir / CARD_FILE
    hf3d_files.write_file(path, "\n".join(lines))  # a new file: never over a card, nor through a link
    return path


def _is_hub_repo(name: str) -> bool:
    """NAMESPACE/NAME and not a file: local paths stay out of the card metadata (the body still names them)."""
    return "/" in name and bool(_HUB_ID.match(name)) and not name.lower().endswith(_FILE_SUFFIXES)


def _public_name(name: str) -> str:
    """A Hub id as is; of a local path only its last part, so that no local directory layout is published."""
    return name if _is_hub_repo(name) else Path(name).name


def _check_summary(summary: Any) -> dict:
    """The summary's types, checked where the trainer (or a user's JSON file) hands it over."""
    if not isinstance(summary, dict):
        raise HubError(f"the training summary must be a dict, got {type(summary).__name__}")
    expected = {
        "base_model": (str, type(None)),
        "started_from": (str, type(None)),
        "datasets": list,
        "license": str,
        "hyperparameters": dict,
        "parallel": dict,
        "tokens_seen": int,
        "final_loss": (int, float, type(None)),
        "final_eval_loss": (int, float, type(None)),
        "loss_curve": list,
        "downstream": dict,
    }
    for key, types in expected.items():
        if key in summary and not isinstance(summary[key], types):
            raise HubError(f"training summary: {key!r} has type {type(summary[key]).__name__}; see hf3d.hf.hub")
    summary = _one_line_values(summary)
    for point in summary.get("loss_curve", []):
        if not (
            isinstance(point, (list, tuple)) and len(point) == 2 and all(isinstance(v, (int, float)) for v in point)
        ):
            raise ValueError(f"training summary: loss_curve entries must be [step, loss] pairs, got {point!r}")
    return summary


_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")  # newlines and the other control characters


def _one_line(text: str) -> str:
    """A value of the card on one line: line breaks and other control characters become one space."""
    return _LINE_BREAKS.sub(" ", text)


def _one_line_values(value: Any) -> Any:
    """`value` with every string in it (keys included, at any depth) on one line."""
    if isinstance(value, str):
        return _one_line(value)
    if isinstance(value, dict):
        return {_one_line_values(k): _one_line_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_one_line_values(v) for v in value)
    return value


def _architecture(model_dir: Path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        return _one_line(f"{config['architectures'][0]} ({layers} layers, hidden size {hidden}) ")
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ""


def _training_section(s: dict) -> list[str]:
    lines = ["## Training", ""]
    base, local = s.get("base_model"), s.get("started_from")
    hub_base = f"[{base}](https://huggingface.co/{base})" if base and _is_hub_repo(base) else None
    if local:
        of = f" of {hub_base}" if hub_base else ""
        lines.append(f"- Continued from `{Path(local).name}` (local weights{of})")
    elif hub_base:
        lines.append(f"- Base model: {hub_base}")
    else:
        lines.append(f"- Started from local weights (`{Path(base).name}`)" if base else "- Trained from scratch")
    if s.get("datasets"):
        lines.append("- Data: " + ", ".join(map(_dataset_link, s["datasets"])))
    if "tokens_seen" in s:
        lines.append(f"- Tokens seen: {s['tokens_seen']:,}")
    if s.get("final_loss") is not None:
        lines.append(f"- Final training loss: {_fmt(s['final_loss'])}")
    if s.get("final_eval_loss") is not None:
        loss = float(s["final_eval_loss"])
        perplexity = math.exp(loss) if loss < 700 else math.inf
        lines.append(f"- Final eval loss: {_fmt(loss)} (perplexity {_fmt(perplexity)})")
    lines.append("")
    if s.get("hyperparameters"):
        lines += ["### Hyperparameters", "", *_table(["name", "value"], sorted(s["hyperparameters"].items())), ""]
    if s.get("parallel"):
        par = s["parallel"]
        lines += ["### Parallel layout", ""]
        if all(isinstance(par.get(k), int) for k in ("tp", "pp", "dp")):
            world = par["tp"] * par["pp"] * par["dp"]
            lines += [f"tp={par['tp']} × pp={par['pp']} × dp={par['dp']} ({world} processes)", ""]
        lines += [*_table(list(par), [list(par.values())]), ""]
    if s.get("downstream"):
        lines += _downstream(s["downstream"])
    if s.get("loss_curve"):
        lines += _loss_curve(s["loss_curve"])
    return lines


def _downstream(scores: dict) -> list[str]:
    """The last downstream evaluation of the run (`hf3d train`'s evals), a row per task and metric."""
    rows = [[task, metric, value] for task, metrics in scores.items() if isinstance(metrics, dict)
            for metric, value in metrics.items()]  # fmt: skip
    if not rows:
        return []
    at = f" at step {scores['step']}" if isinstance(scores.get("step"), int) else ""
    return [f"### Downstream evaluation{at}", "", *_table(["task", "metric", "score"], rows), ""]


def _dataset_link(name: str) -> str:
    """A Hub dataset as a link to its page; a local file or folder by its last part only."""
    return f"[{name}](https://huggingface.co/datasets/{name})" if _is_hub_repo(name) else f"`{_public_name(name)}`"


def _loss_curve(curve: list, max_rows: int = 11, max_spark: int = 60) -> list[str]:
    """A text sparkline of the whole curve and a table of evenly spaced points (first and last included)."""
    steps, losses = [int(p[0]) for p in curve], [float(p[1]) for p in curve]
    finite = [x for x in losses if math.isfinite(x)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    spark = ""
    for i in _evenly(len(losses), max_spark):
        x = losses[i]
        level = 0 if hi == lo or not math.isfinite(x) else round((x - lo) / (hi - lo) * (len(_SPARK) - 1))
        spark += _SPARK[level] if math.isfinite(x) else "?"
    rows = [[steps[i], _fmt(losses[i])] for i in _evenly(len(losses), max_rows)]
    lines = ["### Loss curve", "", f"`{spark}` steps {steps[0]}–{steps[-1]}, loss between {_fmt(lo)} and {_fmt(hi)}"]
    return [*lines, "", *_table(["step", "loss"], rows), ""]


def _evenly(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _fmt(x: Any) -> str:
    """Floats as 4 decimals (losses, learning rates), tiny ones in scientific notation; the rest as str()."""
    if not isinstance(x, float):
        return str(x)
    return f"{x:.4f}" if abs(x) >= 1e-3 else f"{x:g}"


def _table(header: list, rows: list) -> list[str]:
    cell = lambda v: _fmt(v).replace("|", "\\|").replace("\n", " ")
    return [
        "| " + " | ".join(map(cell, header)) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(map(cell, row)) + " |" for row in rows),
    ]


# ------------------------------------------------------------------------------------------------
# Push
# ------------------------------------------------------------------------------------------------
def push_to_hub(
    model_dir: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    retries: int = 3,
    retry_wait_s: float = 1.0,
    request_timeout: float | None = REQUEST_TIMEOUT_S,
    deadline: float | None = None,
) -> str:
    """Upload an HF model directory (+ a model card when it has none) to `repo_id`; returns the commit URL.

    Transient failures (connection errors, 429, 5xx, a request that times out) are retried `retries` times,
    waiting `retry_wait_s`, then twice that, and so on, but none begins after `deadline` (a time.monotonic()
    value). `request_timeout`: seconds a request may wait for an answer, or go without sending or receiving a
    byte, before it fails (set on huggingface_hub's shared client, whose default waits for ever; None leaves
    it). `endpoint` defaults to HF_ENDPOINT / huggingface.co.
    """
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.hf_api import RepoFile

    model_dir = Path(model_dir)
    files = _model_files(model_dir)
    check_repo_id(repo_id)
    token = token or get_token()
    if not token:
        raise HubError(_NO_TOKEN)
    _refuse_token_in(files, model_dir, token)  # before the card, which is made from these files
    if not os.path.lexists(model_dir / CARD_FILE):
        card = write_model_card(model_dir, _read_summary(model_dir), repo_id=repo_id)
        logger.info("wrote the model card %s", card)
        files = _model_files(model_dir)

    if request_timeout is not None:
        import huggingface_hub

        huggingface_hub.get_session().timeout = request_timeout
    api = HfApi(endpoint=endpoint, token=token)
    endpoint = api.endpoint

    def attempt(step: str, fn: Callable[[], T]) -> T:
        return _with_retries(
            fn, step=step, repo_id=repo_id, endpoint=endpoint, retries=retries, wait_s=retry_wait_s, deadline=deadline
        )

    attempt("creating the repo", lambda: api.create_repo(repo_id, private=private, exist_ok=True))
    made = revision not in (None, "main") and attempt(
        f"creating branch {revision!r} of", lambda: _new_branch(api, repo_id, revision)
    )
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(model_dir / rel)) for rel in files]
    message = commit_message or f"Upload {model_dir.resolve().name} with hf3d"
    try:
        commit = attempt(
            "uploading to",
            lambda: api.create_commit(repo_id, operations=operations, commit_message=message, revision=revision),
        )
    except Exception:
        if made:  # the branch this push made holds no commit: deleted, so that no empty step branch stays behind
            with contextlib.suppress(Exception):
                api.delete_branch(repo_id, branch=revision)
        raise
    remote = attempt(
        "checking the upload to",
        lambda: {
            f.path: f.size
            for f in api.list_repo_tree(repo_id, recursive=True, revision=commit.oid)
            if isinstance(f, RepoFile)
        },
    )
    wrong = [rel for rel in files if remote.get(rel) != (model_dir / rel).stat().st_size]
    if wrong:
        raise HubError(
            f"the push to {repo_id} is incomplete: commit {commit.oid} lacks {wrong} or has them at another size "
            "(a .gitignore in the repo?); fix the repo, then push again"
        )
    return commit.commit_url


def _new_branch(api, repo_id: str, revision: str) -> bool:
    """Make the branch `revision`; whether this call made it (False: it was there)."""
    try:
        api.create_branch(repo_id, branch=revision, exist_ok=False)
    except Exception as e:  # noqa: BLE001 - 409: the branch exists; anything else is the caller's to sort
        if _status(e) == 409:
            return False
        raise
    return True


def _model_files(model_dir: Path) -> list[str]:
    """The files to upload (relative POSIX paths; hidden files and folders such as .cache are skipped).

    Links are not followed blindly: a crafted folder could link any local file into an upload. A link to a
    file inside the folder or in the Hub cache (a downloaded snapshot) is uploaded as that file; a link
    leaving them, and any link to a folder, is refused with one line before anything is sent."""
    from .folders import link_outside

    if not model_dir.is_dir():
        raise HubError(f"{model_dir} is not a directory: give the HF model directory to push")
    files = []
    for folder, dirs, names in os.walk(model_dir):  # followlinks=False: a linked folder is listed, not entered
        rel_folder = Path(folder).relative_to(model_dir)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for d in dirs:
            if (Path(folder) / d).is_symlink():
                raise HubError(
                    f"{Path(folder) / d} is a link to a folder; hf3d does not upload linked folders: copy it in"
                )
        for name in names:
            path = Path(folder) / name
            if name.startswith("."):
                continue
            if path.is_symlink() and not path.exists():  # the card writer must not create what it points to
                raise HubError(
                    f"{path} is a link to {os.readlink(path)}, which does not exist; hf3d writes through no link: "
                    "remove the link, or replace it by the file"
                )
            target = link_outside(path, model_dir)
            if target is not None:
                raise HubError(
                    f"{path} is a link to {target}, outside {model_dir}; hf3d uploads no file from outside the "
                    "folder: replace the link by a copy of the file, or remove it"
                )
            if path.is_file():
                files.append((rel_folder / name).as_posix())
    files.sort()
    missing = [] if "config.json" in files else ["config.json"]
    if not any(f.endswith(".safetensors") for f in files):
        missing.append("*.safetensors")
    if missing:
        raise HubError(
            f"{model_dir} is not an HF model directory (no {' and no '.join(missing)}): push the output of "
            "`save_pretrained` or `hf3d convert to-hf`"
        )
    return files


def _read_summary(model_dir: Path) -> dict:
    path = model_dir / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise HubError(f"{path} is not valid JSON ({e}): fix or delete it, then push again") from None


def _refuse_token_in(files: list[str], model_dir: Path, token: str, max_bytes: int = 64 << 20) -> None:
    """A token written into a config or card by mistake must not become public; weights are not scanned."""
    for rel in files:
        path = model_dir / rel
        if (
            not rel.endswith(".safetensors")
            and path.stat().st_size <= max_bytes
            and token.encode() in path.read_bytes()
        ):
            raise HubError(f"{path} contains your Hub token: remove it from the file, then push again")


# ------------------------------------------------------------------------------------------------
# Retries and error messages
# ------------------------------------------------------------------------------------------------
def _with_retries(
    fn: Callable[[], T], *, step: str, repo_id: str, endpoint: str, retries: int, wait_s: float, deadline=None
) -> T:
    """Retries are safe: creating a repo or branch is exist_ok, and a commit is all or nothing."""
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted into transient / final below
            wait = wait_s * 2 ** (attempt - 1)
            late = deadline is not None and time.monotonic() + wait > deadline
            if not _is_transient(e) or attempt > retries or late:
                raise _explain(e, step=step, repo_id=repo_id, endpoint=endpoint, attempts=attempt) from None
            what = f"answered {_status(e)}" if _status(e) else f"gave {type(e).__name__}"
            logger.warning(
                "the Hub %s while %s %s; retry %d of %d in %g s", what, step, repo_id, attempt, retries, wait
            )
            time.sleep(wait)
            attempt += 1


def _causes(e: BaseException):
    """`e` and the exceptions it was raised from (huggingface_hub wraps LFS upload errors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _transport_errors() -> tuple[type[BaseException], ...]:
    try:  # huggingface_hub >= 2 talks through httpx2, 1.x through httpx
        import httpx2 as httpx
    except ImportError:
        import httpx
    return (httpx.TransportError,)


def _status(e: BaseException) -> int | None:
    for c in _causes(e):
        response = getattr(c, "response", None)
        if response is not None and getattr(response, "status_code", None):
            return response.status_code
    return None


def _is_transient(e: BaseException) -> bool:
    status = _status(e)
    if status is not None:
        return status == 429 or status >= 500
    return any(isinstance(c, _transport_errors()) for c in _causes(e))


def _explain(e: BaseException, *, step: str, repo_id: str, endpoint: str, attempts: int) -> BaseException:
    """One line that says what failed and what to do; huggingface_hub's own text only as the detail."""
    status = _status(e)
    where = f"while {step} {repo_id} at {endpoint}"
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    detail = " ".join(str(e).split())[:300]
    if isinstance(e, ValueError) and "README.md" in str(e):  # raised on /api/validate-yaml's answer
        return HubError(f"the Hub refused README.md {where}: {detail}; fix its YAML header, or delete it")
    if status == 401:
        return HubError(f"the Hub refused the token (401) {where}: log in again with `hf auth login` or set HF_TOKEN")
    if status == 403:
        namespace = repo_id.split("/")[0]
        return HubError(
            f"no write access (403) {where}: use a token with write permission for '{namespace}', or a repo you own"
        )
    if status == 404:
        return HubError(f"not found (404) {where}: check the repo id and --revision")
    if status is not None:
        return HubError(f"the Hub answered {status} {where}{tries}: {detail}")
    if any(isinstance(c, _transport_errors()) for c in _causes(e)):
        return HubError(
            f"could not reach the Hub {where}{tries} ({type(e).__name__}: {detail}); "
            "check the network, or HF_ENDPOINT if you set it"
        )
    return e  # not something a user caused: keep the traceback
