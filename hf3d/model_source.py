"""What `hf3d eval` and `hf3d generate` read a model from: an hf3d checkpoint (any mesh), an HF folder or a Hub id,
checked before any model work, then built at the launch's mesh."""

from __future__ import annotations

from pathlib import Path

import torch

from .parallel.config import ParallelConfig


def check_model(model: str, *, scratch: bool = False) -> None:
    """Refuse, in one line and before any model work, what holds no model to read: a path that does not exist, a
    file, a training run's output folder, a checkpoint whose save did not finish, a folder without config.json, and
    one without a tokenizer, and, unless `scratch`, a config.json alone (which parallelize initialises from
    scratch: `hf3d eval` scores that as a baseline, `hf3d generate` would print random text)."""
    from .checkpoint.marker import MARKER, is_complete
    from .parallel.init_weights import has_weights

    path = Path(model).expanduser()
    give = "give an hf3d checkpoint (a step_<N> folder), an HF model folder or a Hub id"
    if not path.exists():
        if model.startswith((".", "/", "~")) or model.count("/") > 1:  # no Hub id has that shape
            raise ValueError(f"model {model} does not exist: {give}")
        return  # a Hub id: fetched (or refused) by parallelize
    if not path.is_dir():
        raise ValueError(f"model {model} is a file: {give}")
    if (path / "checkpoints").is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"model {model} is a training run's folder: give one of its checkpoints ({path / 'checkpoints'}/"
            f"step_<N>) or its export {path / 'final'}"
        )
    if not is_complete(path) and any(path.glob("*.distcp")):
        raise ValueError(f"model {model} is a checkpoint whose save did not finish (no {MARKER}): use another step_<N>")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model} holds no model (no config.json): {give}")
    if not (is_complete(path) or has_weights(path) or scratch):
        raise ValueError(f"model {model} holds a config.json but no weights (a folder to train from scratch): {give}")
    if not any(path.glob("tokenizer*")) and not (path / "vocab.json").is_file():
        raise ValueError(
            f"model {model} has no tokenizer (tokenizer.json, tokenizer_config.json): copy the tokenizer files of "
            "the model it was trained from into it"
        )


def load_model(path: str, pcfg: ParallelConfig, *, dtype: torch.dtype, attn_implementation: str):
    """The model at this mesh: an HF folder or Hub id through parallelize; an hf3d checkpoint's weights read
    into the model its config.json describes."""
    from .checkpoint.load import load_checkpoint
    from .checkpoint.marker import is_complete
    from .parallelize import parallelize

    pmodel = parallelize(path, pcfg, dtype=dtype, attn_implementation=attn_implementation)
    if is_complete(path):
        load_checkpoint(path, pmodel)
    return pmodel
