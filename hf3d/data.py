"""Token streams: JSONL/text files -> tokenizer -> one packed stream -> fixed-length rows.

Documents are joined with the tokenizer's EOS token and cut into rows of seq_len + 1 tokens
(inputs and shifted labels share a row, HF style: labels == input_ids). Every dp rank builds
the same row order (seeded shuffle) and takes its own slice of each global batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class DataConfig:
    """Where the training text comes from and how it is cut."""

    path: str = "examples/data/shakespeare.jsonl"
    """A .jsonl file (one document per line, field `text_field`) or a plain .txt file."""
    text_field: str = "text"
    """The JSON field holding each document's text."""
    seq_len: int = 128
    """Tokens per training row."""
    seed: int = 0
    """Seed of the row shuffle."""

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.seq_len}")


def read_documents(cfg: DataConfig) -> list[str]:
    path = Path(cfg.path)
    if not path.is_file():
        raise ValueError(f"data.path {cfg.path!r} is not a file; give a .jsonl or .txt file")
    if path.suffix != ".jsonl":
        return [path.read_text()]
    docs = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)[cfg.text_field])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{cfg.path}:{line_no}: expected a JSON object with a {cfg.text_field!r} field ({e})"
                ) from e
    if not docs:
        raise ValueError(f"{cfg.path} holds no documents")
    return docs


def packed_rows(cfg: DataConfig, tokenizer) -> torch.Tensor:
    """[num_rows, seq_len] token ids from all documents, EOS between documents, shuffled."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in read_documents(cfg):
        # line by line (one batched call): fast, and no line exceeds the tokenizer's max length
        for line_ids in tokenizer(doc.splitlines(keepends=True), add_special_tokens=False)["input_ids"]:
            ids.extend(line_ids)
        if eos is not None:
            ids.append(eos)
    num_rows = len(ids) // cfg.seq_len
    if num_rows == 0:
        raise ValueError(f"{cfg.path} has {len(ids)} tokens, fewer than one row of seq_len={cfg.seq_len}")
    rows = torch.tensor(ids[: num_rows * cfg.seq_len]).view(num_rows, cfg.seq_len)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(cfg.seed))
    return rows[order]


class BatchIterator:
    """Endless global batches of rows; yields this dp rank's slice [d*B/dp, (d+1)*B/dp)."""

    def __init__(self, rows: torch.Tensor, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        if rows.shape[0] < global_batch:
            raise ValueError(f"the data holds {rows.shape[0]} rows, fewer than one global batch of {global_batch}")
        self.rows, self.global_batch = rows, global_batch
        per = global_batch // dp_size
        self.local = slice(dp_rank * per, (dp_rank + 1) * per)
        self.position = 0
        self.epoch = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self.position + self.global_batch > self.rows.shape[0]:
            self.position, self.epoch = 0, self.epoch + 1
        batch = self.rows[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        return batch[self.local]
