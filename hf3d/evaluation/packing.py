"""Units packed into rows of a fixed length, rows into batches: what one scoring forward reads.

Rows are filled best-fit decreasing (the longest unit first, each into the row it fills the most), so the
padding left at the rows' ends is small. A unit lays out as hf3d.parallel.segments describes: its context at
positions 0..m-1, then each continuation but its last token at positions m.. again. Each predicted token is a
query: (row, column whose output predicts it, the token, the pair it belongs to). The first token of every
continuation is predicted at the context's last column; token j > 0 at the column of token j - 1.

Without a tree (`tree=False`) every unit holds one pair and the rows are plain packed documents: positions
restart at each unit and stock's mask builders (or flash attention's varlen boundaries) keep them apart.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..parallel.segments import Segments
from .requests import Unit


@dataclass
class Batch:
    """Rows [b, S] and their queries [Q]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: Segments | None
    query_rows: torch.Tensor
    query_cols: torch.Tensor
    query_targets: torch.Tensor
    query_pairs: torch.Tensor
    tokens: int  # the tokens of the units (the rows hold them and padding)

    @property
    def num_queries(self) -> int:
        return len(self.query_targets)


def fill_rows(units: list[Unit], row_len: int) -> list[list[Unit]]:
    """Best-fit decreasing: each unit, longest first, into the row whose room it fills the most."""
    rows: list[list[Unit]] = []
    room: list[tuple[int, int]] = []  # (free positions, row index), sorted
    for unit in sorted(units, key=lambda u: -u.length):  # stable: equal lengths keep their order
        n = unit.length
        assert 0 < n <= row_len, f"a unit of {n} positions in rows of {row_len}"
        at = bisect.bisect_left(room, (n, -1))
        if at == len(room):
            rows.append([unit])
            bisect.insort(room, (row_len - n, len(rows) - 1))
        else:
            free, index = room.pop(at)
            rows[index].append(unit)
            bisect.insort(room, (free - n, index))
    return rows


class _RowWriter:
    """The tensors of one batch, written unit by unit."""

    def __init__(self, num_rows: int, row_len: int, pad_id: int):
        self.ids = torch.full((num_rows, row_len), pad_id, dtype=torch.long)
        self.pos = torch.arange(row_len).repeat(num_rows, 1)  # padding: positions counting from 0
        self.doc = torch.zeros(num_rows, row_len, dtype=torch.long)
        self.branch = torch.zeros(num_rows, row_len, dtype=torch.long)
        self.queries: list[tuple[int, int, int, int]] = []  # (row, col, target, pair)
        self.tokens = 0

    def put(self, row: int, col: int, doc: int, unit: Unit) -> int:
        """Write `unit` at (row, col); returns the column after it."""
        m = len(unit.context)
        self._write(row, col, unit.context, 0, doc, 0)
        start = col + m
        for k, (pair, cont) in enumerate(unit.branches, start=1):
            assert cont, f"pair {pair} has no continuation token (requests.encode_examples refuses such a choice)"
            self.queries.append((row, col + m - 1, cont[0], pair))
            self.queries += [(row, start + j - 1, cont[j], pair) for j in range(1, len(cont))]
            self._write(row, start, cont[:-1], m, doc, k)
            start += len(cont) - 1
        self.pos[row, start:] = torch.arange(self.pos.shape[1] - start)  # the padding after it restarts
        self.tokens += start - col
        return start

    def _write(self, row: int, col: int, ids: list[int], first_pos: int, doc: int, branch: int) -> None:
        n = len(ids)
        self.ids[row, col : col + n] = torch.tensor(ids, dtype=torch.long)
        self.pos[row, col : col + n] = torch.arange(first_pos, first_pos + n)
        self.doc[row, col : col + n] = doc
        self.branch[row, col : col + n] = branch


def make_batches(
    units: list[Unit], *, row_len: int, rows_per_batch: int, tree: bool, pad_id: int, full_batches: bool
) -> list[Batch]:
    """The units in rows of `row_len`, `rows_per_batch` rows a batch. full_batches: the last batch is padded
    with empty rows to the same shape (compiled layers see one shape; expert parallelism runs every batch)."""
    rows = fill_rows(units, row_len)
    batches = []
    for lo in range(0, len(rows), rows_per_batch):
        chunk = rows[lo : lo + rows_per_batch]
        writer = _RowWriter(rows_per_batch if full_batches else len(chunk), row_len, pad_id)
        for r, row_units in enumerate(chunk):
            col = 0
            for doc, unit in enumerate(row_units, start=1):
                col = writer.put(r, col, doc, unit)
        batches.append(_batch(writer, tree))
    return batches


def empty_batch(*, row_len: int, rows: int, tree: bool, pad_id: int) -> Batch:
    """A batch of padding only, no query: what a rank with fewer batches runs while its expert group scores."""
    return _batch(_RowWriter(rows, row_len, pad_id), tree)


def _batch(writer: _RowWriter, tree: bool) -> Batch:
    q = torch.tensor(writer.queries, dtype=torch.long).reshape(-1, 4)
    return Batch(
        input_ids=writer.ids,
        position_ids=writer.pos,
        segments=Segments(writer.doc, writer.branch) if tree else None,
        query_rows=q[:, 0],
        query_cols=q[:, 1],
        query_targets=q[:, 2],
        query_pairs=q[:, 3],
        tokens=writer.tokens,
    )
