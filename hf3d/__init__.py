"""hf3d: tensor, pipeline and data (ZeRO-1) parallel training of stock transformers models.

The public names load on first use: `import hf3d` alone imports neither torch nor transformers, so the
`hf3d` command answers --help at once and reads a config before the slow imports.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

from .utils.noise import quiet_known_noise  # noqa: E402 - logging only: no torch is imported

quiet_known_noise()

_SOURCES = {
    "FP8Config": ".parallel.fp8",
    "ParallelConfig": ".parallel.config",
    "ParallelModel": ".model",
    "ParallelOptimizer": ".optim.zero",
    "TaskEvalConfig": ".evaluation.config",
    "Trainer": ".integrations.transformers_trainer",
    "build_optimizer": ".optim.build",
    "evaluate_tasks": ".evaluation.evaluator",
    "finish": ".utils.faults",
    "load_checkpoint": ".checkpoint.load",
    "parallelize": ".parallelize",
    "prepare": ".integrations.accelerate",
    "save_checkpoint": ".checkpoint.save",
}

__all__ = [
    "FP8Config",
    "ParallelConfig",
    "ParallelModel",
    "ParallelOptimizer",
    "TaskEvalConfig",
    "Trainer",
    "build_optimizer",
    "evaluate_tasks",
    "finish",
    "load_checkpoint",
    "parallelize",
    "prepare",
    "save_checkpoint",
]

if TYPE_CHECKING:
    from .checkpoint.load import load_checkpoint
    from .checkpoint.save import save_checkpoint
    from .evaluation.config import TaskEvalConfig
    from .evaluation.evaluator import evaluate_tasks
    from .integrations.accelerate import prepare
    from .integrations.transformers_trainer import Trainer
    from .model import ParallelModel
    from .optim.build import build_optimizer
    from .optim.zero import ParallelOptimizer
    from .parallel.config import ParallelConfig
    from .parallel.fp8 import FP8Config
    from .parallelize import parallelize
    from .utils.faults import finish


def __getattr__(name: str):
    """A public name from its module, or a submodule (`hf3d.train.metrics`), imported on first use."""
    if name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name], __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'hf3d' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # importing the submodule hf3d.parallelize sets the package's `parallelize` to that module; the
        # public name stays the function, as it was when this file imported everything
        if name in _SOURCES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
