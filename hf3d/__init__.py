"""hf3d: tensor, pipeline and data (ZeRO-1) parallel training of stock transformers models."""

from .accel import prepare
from .checkpoint import load_checkpoint, save_checkpoint
from .config import ParallelConfig
from .faults import finish
from .model import ParallelModel
from .optim import ParallelOptimizer, build_optimizer
from .parallelize import parallelize

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig",
    "ParallelModel",
    "ParallelOptimizer",
    "Trainer",
    "build_optimizer",
    "finish",
    "load_checkpoint",
    "parallelize",
    "prepare",
    "save_checkpoint",
]


def __getattr__(name: str):
    if name == "Trainer":  # transformers' Trainer takes seconds to import: load it on first use
        from .hf_trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'hf3d' has no attribute {name!r}")
