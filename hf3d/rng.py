"""The old path of hf3d.parallel.rng, which the README named (`hf3d.rng.seed_streams`): kept for code that uses it."""

from .parallel.rng import seed_streams

__all__ = ["seed_streams"]
