"""Where each slice of a runtime parameter comes from in the stock HF state dict.

hf3d keeps HF names and global shapes as the only names that leave a rank (checkpoints,
exports, optimizer state). A runtime parameter — a fused qkv_proj slice, a padded vocab
shard — is a concatenation, along one dim, of `Piece`s: ranges of HF tensors. Rows of the
runtime parameter that no piece covers are padding (zero, never exported).

A piece held by several tensor-parallel ranks (norms, replicated KV heads) has exactly one
`owner`, who exports it and counts it in the gradient norm. A replicated KV-head piece is
also `partial_grad`: each holder computes only its own query heads' share of the gradient,
so the holders' gradients are summed before the optimizer step.

A 3-D runtime parameter is a stack of 2-D slabs (a MoE layer's local experts, [experts, rows, cols]):
its pieces name the slab they lie in (`stack`), and `dim` is a dim of that slab.
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
    stack: int | None = None  # the slab of a 3-D runtime parameter this piece lies in

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        slab = tensor if self.stack is None else tensor[self.stack]
        return slab.narrow(self.dim, self.local_start, self.local_stop - self.local_start)


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


# -- boxes: the rectangles of global HF tensors that a flat range of a runtime parameter covers ------------
def _flat_boxes(shape: tuple[int, ...], a: int, z: int) -> list[tuple[list[int], list[int], int]]:
    """Split the row-major element range [a, z) of a 1-D or 2-D tensor into rectangles, each one a
    contiguous run of elements: (offsets, sizes, first flat index)."""
    if len(shape) == 1:
        return [([a], [z - a], a)] if z > a else []
    assert len(shape) == 2, f"hf3d checkpoints hold 1-D and 2-D tensors, got shape {shape}"
    cols = shape[1]
    (r0, c0), (r1, c1) = divmod(a, cols), divmod(z, cols)
    if r0 == r1:
        return [([r0, c0], [1, c1 - c0], a)] if c1 > c0 else []
    out = []
    if c0:
        out.append(([r0, c0], [1, cols - c0], a))
        r0 += 1
    if r1 > r0:
        out.append(([r0, 0], [r1 - r0, cols], r0 * cols))
    if c1:
        out.append(([r1, 0], [1, c1], r1 * cols))
    return out


def hf_boxes(param, flat, flat_start: int, a: int, z: int, *, owned_only: bool):
    """The HF boxes of runtime parameter `param` over its element range [a, z).

    `flat` is a 1-D tensor holding param's row-major elements from `flat_start` on (the parameter
    itself, a ZeRO master fragment, or optimizer state shaped like it). Yields
    (hf_name, hf_offsets, sizes, view of flat): runtime rows or columns map to HF ones through the
    layout pieces; vocab padding (covered by no piece) is skipped, and so are replicas this rank does
    not own when `owned_only`."""
    shape = tuple(param.shape)
    if len(shape) == 3:  # a stack of slabs: each slab's part of [a, z) on its own
        size = shape[1] * shape[2]
        slabs = [(k, shape[1:], k * size) for k in range(shape[0]) if k * size < z and a < (k + 1) * size]
    else:
        slabs = [(None, shape, 0)]
    for stack, slab, base in slabs:
        lo, hi = max(a, base) - base, min(z, base + _numel(slab)) - base
        yield from _slab_boxes(param, slab, stack, flat, flat_start - base, lo, hi, owned_only)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _slab_boxes(param, shape, stack, flat, flat_start, a, z, owned_only):
    for offsets, sizes, start in _flat_boxes(shape, a, z):
        n = _numel(sizes)
        box = flat[start - flat_start : start - flat_start + n].view(sizes)
        for piece in get_pieces(param):
            if (owned_only and not piece.owner) or piece.stack != stack:
                continue
            d = piece.dim
            lo, hi = max(offsets[d], piece.local_start), min(offsets[d] + sizes[d], piece.local_stop)
            if lo >= hi:
                continue
            hf_off, hf_size = list(offsets), list(sizes)
            hf_off[d], hf_size[d] = lo - piece.local_start + piece.hf_start, hi - lo
            yield piece.hf_name, hf_off, hf_size, box.narrow(d, lo - offsets[d], hi - lo)
