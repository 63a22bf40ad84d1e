"""What an HF model folder holds, and the one rule of every hf3d writer: which folder it may replace, which files
travel with the weights, and which links are never followed."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..utils import files

SAFE_INDEX = "model.safetensors.index.json"


SAFE_SINGLE = "model.safetensors"


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local HF directory, or a Hub id fetched (config, safetensors, tokenizer) into the HF cache."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but has no config.json; point at an HF model directory")
        return path
    text = str(name_or_path)
    looks_like_id = text.count("/") <= 1 and not text.startswith((".", "/", "~")) and path.suffix == ""
    if path.exists() or not looks_like_id:
        raise ValueError(
            f"{text!r} is neither an HF model directory nor a Hub model id (like 'HuggingFaceTB/SmolLM2-135M')"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        local = snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except (RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(
            f"could not fetch {text!r} from the Hub, and no local folder has that name ({type(e).__name__}: {e})"
        ) from e
    return Path(local)


GENERATION_CONFIG = "generation_config.json"


# files of an HF model dir that travel with the weights (tokenizer, chat template, generation defaults)
_MODEL_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template")


# what an HF model folder holds as hf3d writes it (hf3d train adds its record, loss curve and model card), and
# what transformers' save_pretrained writes: the only files an export may replace
_EXPORT_FILES = {
    "config.json",
    GENERATION_CONFIG,
    SAFE_SINGLE,
    SAFE_INDEX,
    "hf3d_training.json",
    "loss_curve.png",
    "README.md",
}


PROBE_PREFIX = ".hf3d-probe-"
"""A file a sharded export writes into its staging folder to see that every writer sees it (removed at once)."""


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_weights_file(name: str) -> bool:
    """Whether `name` is a safetensors weights file (or its index) as transformers names them."""
    return name in (SAFE_SINGLE, SAFE_INDEX) or bool(_SHARD_FILE.fullmatch(name))


def is_model_file(name: str) -> bool:
    """Whether `name` is a file that travels with the weights (generation defaults, tokenizer, chat template)."""
    return name == GENERATION_CONFIG or name.startswith(_MODEL_FILE_PREFIXES)


def is_export_file(name: str) -> bool:
    """Whether `name` is a file an HF export holds (weights, configs, tokenizer files, hf3d's run record)."""
    return name in _EXPORT_FILES or bool(_SHARD_FILE.fullmatch(name)) or is_model_file(name)


EXPORT = files.Kind("export", lambda name: is_export_file(name) or name.startswith(PROBE_PREFIX))
"""An HF folder hf3d writes (save_pretrained, `convert to-hf`, `hf3d train`'s final/) and its staging folder."""


def check_output_dir(out: Path, kind: files.Kind, *, src: str | os.PathLike | None = None) -> None:
    """The one rule of every hf3d writer (save_pretrained, `convert`, `hf3d train`'s final export,
    Trainer.save_model): `out` is written when it does not exist, is an empty folder, or is a folder of `kind`
    that hf3d made holding only files it writes there (an earlier output, which is replaced). Anything else
    (a folder of the user's, even one of model files; a file of the user's in hf3d's folder, a subfolder, a
    link; a copy of hf3d's folder; a folder of another kind) is refused in one line (`files.refusal`), before
    anything is written or deleted."""
    if src is not None and out.resolve() == Path(src).resolve():
        raise ValueError(f"the output {out} is the input; choose another output path")
    files.check_replaceable(out, kind)


def link_outside(path: Path, root: Path) -> Path | None:
    """Where `path` points when it is a symlink to a place outside `root` and outside the Hub cache; else None.

    The Hub client's downloads are links into its cache (snapshots/<rev>/f -> ../../blobs/<hash>), so those
    are followed; any other link leaving the folder could pull an unrelated local file (a key, a token) into
    an export or an upload."""
    if not path.is_symlink():
        return None
    from huggingface_hub import constants

    target = path.resolve()
    inside = [Path(root).resolve(), Path(constants.HF_HUB_CACHE).resolve()]
    return None if any(target.is_relative_to(d) for d in inside) else target


def model_files(src_dir: str | os.PathLike) -> list[Path]:
    """generation_config.json, the tokenizer files and the chat template of an HF model dir (or a checkpoint),
    those that exist. A link to a file outside the folder (and outside the Hub cache) is refused, not skipped:
    an export without its tokenizer would look complete, and copying it could publish any local file."""
    src = Path(src_dir)
    found = []
    for f in sorted(src.iterdir()):
        if f.is_file() and (f.name == GENERATION_CONFIG or f.name.startswith(_MODEL_FILE_PREFIXES)):
            target = link_outside(f, src)
            if target is not None:
                raise ValueError(
                    f"{f} is a link to {target}, outside {src}; hf3d copies no file from outside the model folder "
                    "into an export (it could be pushed): replace the link by a copy of the file"
                )
            found.append(f)
    return found


def copy_model_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy `model_files(src_dir)` into dst_dir; returns the names copied."""
    copied = []
    for f in model_files(src_dir):
        files.copy_file(f, Path(dst_dir) / f.name)
        copied.append(f.name)
    return copied
