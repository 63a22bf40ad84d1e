"""The data pipeline for (continued) pretraining.

config.py    the `data` section: SourceConfig, StageConfig, EvalConfig, DataConfig
sources.py   files / Hub datasets -> tokens cached as flat arrays; datatrove shards; windows
packing.py   a window of seq_len + 1 tokens -> input_ids, shift_labels, position_ids
pipeline.py  DataPipeline: stages of weighted mixtures, per-source cursors, dp slices, state, eval

pipe = DataPipeline(cfg, tokenizer, global_batch=B, dp_rank=d, dp_size=dp, total_steps=N,
                    local_main=local_rank == 0, barrier=...)
batch = pipe.next_batch(step)   # this dp rank's rows: input_ids, shift_labels, position_ids
"""

from .config import DataConfig, EvalConfig, SourceConfig, StageConfig
from .packing import IGNORE_INDEX, collate, pack_window
from .pipeline import DataPipeline
from .sources import TokenSource

__all__ = [
    "IGNORE_INDEX",
    "DataConfig",
    "DataPipeline",
    "EvalConfig",
    "SourceConfig",
    "StageConfig",
    "TokenSource",
    "collate",
    "pack_window",
]
