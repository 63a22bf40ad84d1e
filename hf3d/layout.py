"""Where each slice of a runtime parameter comes from in the stock HF state dict.

hf3d keeps HF names and global shapes as the only names that leave a rank (checkpoints,
exports, optimizer state). A runtime parameter — a fused qkv_proj slice, a padded vocab
shard — is a concatenation, along one dim, of `Piece`s: ranges of HF tensors. Rows of the
runtime parameter that no piece covers are padding (zero, never exported).

A piece held by several tensor-parallel ranks (norms, replicated KV heads) has exactly one
`owner`, who exports it and counts it in the gradient norm. A replicated KV-head piece is
also `partial_grad`: each holder computes only its own query heads' share of the gradient,
so the holders' gradients are summed before the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    hf_name: str
    dim: int  # the dim along which runtime and HF ranges are taken
    hf_start: int
    hf_stop: int
    local_start: int
    local_stop: int
    owner: bool = True
    partial_grad: bool = False  # several tp ranks hold it and each has a partial gradient

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.local_start, self.local_stop - self.local_start)


def concat_pieces(
    parts: list[tuple[str, int, int]], *, dim: int, owner: bool = True, partial_grad: bool = False
) -> list[Piece]:
    """[(hf_name, hf_start, hf_stop), ...] laid out back to back along `dim`."""
    pieces, offset = [], 0
    for hf_name, start, stop in parts:
        pieces.append(Piece(hf_name, dim, start, stop, offset, offset + stop - start, owner, partial_grad))
        offset += stop - start
    return pieces


def whole(hf_name: str, size0: int, *, owner: bool) -> list[Piece]:
    """A parameter every tp rank holds in full (norms, row-parallel biases)."""
    return [Piece(hf_name, 0, 0, size0, 0, size0, owner)]


def set_pieces(param: torch.nn.Parameter, pieces: list[Piece]) -> None:
    param.hf3d_pieces = pieces


def get_pieces(param: torch.Tensor) -> list[Piece]:
    return param.hf3d_pieces


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    assert total % num_shards == 0, (total, num_shards)
    size = total // num_shards
    return index * size, (index + 1) * size
