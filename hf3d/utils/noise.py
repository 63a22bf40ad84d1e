"""Lines other libraries print that say nothing to an hf3d user, filtered at `import hf3d`.

With torchao installed (the `fp8` and `dev` extras), transformers imports it whenever it imports its model code,
FP8 on or off, and two kinds of records follow on every run (FACTS: harmless):
- torchao's "Failed to load .../_C_mxfp8...so" and "_C_cutlass_90a" warnings: CUDA kernels that cannot load
  where there is no CUDA device. Kept where there is one: there they may matter.
- torch's "<enum ...> is an Enum subclass and is now natively supported by torch.compile ... register_constant()"
  deprecation, about torchao's own code.
Only these records are dropped; every other record of both loggers passes.
"""

from __future__ import annotations

import logging


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.name.startswith("torchao") and text.startswith("Failed to load") and "/torchao/_C" in text:
            import torch

            return torch.cuda.is_available()
        return not (record.name == "torch.utils._pytree" and "is an Enum subclass and is now natively" in text)


def quiet_known_noise() -> None:
    """Install the filter on the two loggers (once)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise())
