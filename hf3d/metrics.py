"""Per-step metrics: metrics.jsonl on the main process, throughput, MFU, memory."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

# dense bf16 peak FLOP/s per device, from the vendors' data sheets
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_bytes() -> int:
    """Peak accelerator memory on CUDA, else this process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 * parameters of the matmuls + attention (PaLM appendix B)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    dense = layers * (attn + 3 * h * config.intermediate_size) + h * config.vocab_size
    return 6 * dense + 12 * layers * config.num_attention_heads * d * seq_len


class MetricsWriter:
    """Appends one JSON object per step to <output_dir>/metrics.jsonl (main process only), flushed
    (the file closed) after every step.

    A fresh run empties the file. A run resumed at step N keeps the records of steps 1..N and drops
    later ones (steps the interrupted run did after its last checkpoint, which are trained again)."""

    def __init__(self, output_dir: Path, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # a line cut short by the interruption ends what is kept
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
