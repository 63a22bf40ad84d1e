"""Training checkpoints: torch.distributed.checkpoint (DCP) files keyed by HF names and global offsets.

A checkpoint folder holds

    .metadata, __<rank>_0.distcp   DCP: every rank writes only the boxes it owns, in parallel
    config.json                    the HF model config (+ generation_config.json, tokenizer files)
    rng_<rank>.pt                  each rank's RNG states (training checkpoints)
    extra.pt                       the caller's `extra` (scheduler, data position), from rank 0
    hf3d_checkpoint.json           written last: its presence marks the folder complete; it records
                                   each other file's size and CRC-32, checked before a load

DCP keys are `model/<hf name>` (parameters, in the training dtype), `optim/master/<hf name>`
(fp32 master weights, only when they differ from the parameters) and `optim/<state>/<hf name>`
(the wrapped optimizer's per-element state, e.g. exp_avg). Every tensor has its global, unfused,
unpadded HF shape, so a checkpoint loads on any (tp, pp, dp) and converts to HF without a mesh.
A weights-only checkpoint (`hf3d convert from-hf`) has `model/*` keys only.

Saving is atomic and durable: files go into `<path>.tmp` (a folder of hf3d's own, hf3d/utils/files.py), the
marker is written last, every file and folder is fsynced, then the folder takes the name `<path>` in one
rename (swapped with the checkpoint it replaces, which only then is removed). A folder without the marker is
never loaded. hf3d replaces or deletes only checkpoint folders it made there holding only the files it wrote
(`CHECKPOINT`); a `<path>` or `<path>.tmp` of anyone else's, a copy and an export are refused before anything
is written. The marker also records the save's `sequence` under its folder: resume
and rotation go by the order of the saves, not of the step numbers. A marked folder whose files no
longer match the sizes and checksums in its marker (a truncated or rewritten file) is damaged: loading
it is refused with one line, and `checkpoint.resume: auto` passes over it to the previous checkpoint.
Markers written before hf3d recorded the files (no "files" entry) load once every file in the folder is
found to be a regular file, not a link.
"""

from .entries import MASTER_KEY, MODEL_PREFIX, model_key, optim_key
from .failures import CheckpointWriteError
from .load import load_checkpoint
from .marker import CHECKPOINT, MARKER, file_table, find_damage, is_complete, read_marker, staging_dir, write_marker
from .reader import SafeReader
from .rotation import clean_leftovers, find_resume, finish_save, next_sequence, resolve_resume, step_dirs
from .save import PendingCheckpoint, prepare_async_save, save_checkpoint, wait_for_checkpoint

__all__ = [
    "CHECKPOINT",
    "MARKER",
    "MASTER_KEY",
    "MODEL_PREFIX",
    "CheckpointWriteError",
    "PendingCheckpoint",
    "SafeReader",
    "clean_leftovers",
    "file_table",
    "find_damage",
    "find_resume",
    "finish_save",
    "is_complete",
    "load_checkpoint",
    "model_key",
    "next_sequence",
    "optim_key",
    "prepare_async_save",
    "read_marker",
    "resolve_resume",
    "save_checkpoint",
    "staging_dir",
    "step_dirs",
    "wait_for_checkpoint",
    "write_marker",
]
