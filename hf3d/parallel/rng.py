"""Per-rank random streams for dropout (the role of Megatron's model-parallel RNG tracker).

Stock dropout draws every mask from torch's default generator. Split over a mesh, that rule would
give wrong statistics: the tp ranks of one replica hold different attention heads, and with equal
seeds they would draw the same mask for different heads; pp stages and dp replicas would repeat one
another's masks on other layers and other rows. hf3d keeps two streams per rank:

- the tensor-parallel stream (`DropoutRNG`): dropout inside a tensor-parallel region, i.e. attention
  dropout over this rank's heads (`TPAttention`), draws from a generator state of its own, seeded from
  (seed, pp rank, dp rank, cp rank, tp rank). The attention call swaps it in as the default generator's state
  and back out (`fork`), so every attention backend (eager, sdpa, flex) draws from it unchanged;
- the shared stream: dropout on activations replicated over tp (none in the families supported
  today) must draw the same mask on every tp rank. It is torch's default generator, which
  `seed_streams` seeds from (seed, pp rank, dp rank, cp rank): the same on the tp ranks of one (pp, dp,
  cp) coordinate, different across pp stages, dp replicas and the cp ranks' tokens.

So masks are independent Bernoulli(1 - p) draws per head, row and layer, as in stock: the statistics
of stock dropout, not its exact masks (those depend on how the heads and rows are split). With
dropout 0, or in eval mode, nothing is forked or drawn. Activation recompute replays the masks of
the first forward (`recompute_context`). Checkpoints save each rank's streams (rng_<rank>.pt) and
restore them on the same mesh, so a resumed run is bit for bit the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

_SHARED, _TENSOR_PARALLEL = 0, 1  # first words of the derived seeds: the two streams never meet


def derive_seed(*words: int) -> int:
    """A 63-bit seed that is a function of `words` (a seed and rank coordinates)."""
    digest = hashlib.sha256(",".join(str(int(w)) for w in words).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _generator_state(device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


class DropoutRNG:
    """This rank's tensor-parallel dropout stream: a generator state, swapped in by `fork`.

    coords: this rank's (pp, dp, cp, tp) ranks. Seeded by `manual_seed`, or, when nothing seeded it, on
    first use from `torch.initial_seed()` (what the last `torch.manual_seed` set), so a plain
    `torch.manual_seed(s)` before training seeds it too."""

    def __init__(self, coords: tuple[int, ...], device: torch.device):
        self.coords, self.device = tuple(int(c) for c in coords), torch.device(device)
        self.seed: int | None = None
        self._state: torch.Tensor | None = None

    def manual_seed(self, seed: int, *, step: int = 0) -> None:
        """Seed the stream from (seed, coords); step > 0 starts a stream that differs from step 0's."""
        self.seed = int(seed)
        words = (self.seed, _TENSOR_PARALLEL, *self.coords) + ((step,) if step else ())
        self._state = _generator_state(self.device, derive_seed(*words))

    def state(self) -> torch.Tensor:
        if self._state is None:
            self.manual_seed(torch.initial_seed())
        return self._state

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self):
        """Run the body with this stream as the device's default generator; the default generator's
        own state is left as it was."""
        outside = self._get()
        self._set(self.state())
        try:
            yield
        finally:
            self._state = self._get()
            self._set(outside)

    def recompute_context(self):
        """`context_fn` for torch.utils.checkpoint: the recomputed forward runs from the stream's state
        at the first forward, so it draws the same masks; the live state is kept for what follows."""
        at_forward = self.state()

        @contextlib.contextmanager
        def replay():
            live, self._state = self._state, at_forward
            try:
                yield
            finally:
                self._state = live

        return contextlib.nullcontext(), replay()

    def state_dict(self) -> dict:
        state = self.state()  # first: a stream never used is seeded here, and its seed recorded with it
        return {"seed": self.seed, "coords": list(self.coords), "state": state}

    def load_state_dict(self, saved: dict) -> None:
        self.seed, self._state = saved["seed"], saved["state"]


def seed_streams(pmodel, seed: int) -> None:
    """Seed this rank's two dropout streams from `seed` (every rank passes the same seed): torch's
    default generator from (seed, pp, dp, cp), shared by the tp ranks; the model's tensor-parallel stream
    from (seed, pp, dp, cp, tp)."""
    torch.manual_seed(derive_seed(int(seed), _SHARED, pmodel.pp_rank, pmodel.dp_rank, pmodel.cp_rank))
    pmodel.dropout_rng.manual_seed(seed)
