"""Random draws (dropout masks, router noise) inside a region that is run again in backward, replayed exactly.

Holds:
    Draws: one chunked forward's draws: a seed taken once from the global generator, and a generator state per
        region (a chunk of a layer, on a rank) derived from it.
    generators_kept: a context in which a one-time probe may draw; the global generators are as they were after it.

The regions StreamBP, mini_seq and the checkpointed layers re-run are not re-run the way they first ran: the K/V
capture pass stops each chunk at its cache update, the backward replays chunks last-first, a probe runs a layer
on its first tokens, under sequence parallelism a second pass runs the chunks again for their keys' gradient. A
draw that followed from the generator state left by whatever ran before it (what ``torch.utils.checkpoint`` does
for one region replayed whole) would shift with each of those. So each region starts from its own state, set
from ``(seed, *key)`` when it is entered (the chunk's position, the rank): a draw depends on where it happens,
not on what ran before, and every run of a region draws the same masks, in the same order, for its same ops (the
capture pass runs a prefix of the chunk's ops, so it draws a prefix of the chunk's draws). Nothing is stored but
the seed: memory is that of the run without dropout.

Fresh masks each step, as in a stock model, and nothing changed where nothing draws: :meth:`Draws.take` reads the
seed off the global CPU generator's state without drawing from it, so the masks follow from the global state when
the forward starts (re-seeding before a forward reproduces them); :meth:`Draws.advance`, called once the forward
ran, advances the global generator by one draw if some region drew anything, so the next forward draws new masks.
A module that draws nothing (no dropout) leaves the global generators exactly as a stock run does, and the draws
a stock run makes around it (an embedding dropout, the stock attention's under mini_seq) stay the stock ones. No
list of which modules draw is needed: a draw nobody declared (a family's functional dropout) is replayed too.

The generators a region sets: the CPU's default one and, when ``device`` is a CUDA device, that device's.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from typing import Iterator

import torch

__all__ = ["Draws", "generators_kept"]

_MASK = (1 << 63) - 1


@contextlib.contextmanager
def generators_kept(device: torch.device | None = None) -> Iterator[None]:
    """Within: a one-time probe (a check that a module is token-wise, that a mixer reads its carried state, that a
    linear's output goes unread) runs the module, dropout and router noise included; on exit the global CPU
    generator and ``device``'s CUDA generator (when it is one) are as they were, so the first training forward
    draws what every later one with the same seed draws, and what a stock model's would (``torch.utils.checkpoint``
    forks the generators around its recompute for the same reason)."""
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def _mix(*numbers: int) -> int:
    """A 63-bit seed from integers: the same numbers give the same seed on every platform and run."""
    data = struct.pack(f"<{len(numbers)}q", *(n & _MASK for n in numbers))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK


class Draws:
    """The random draws of one chunked forward of a module (a StreamBP layer, a mini_seq MLP), replayable region
    by region.

    ``seed``: where every region's generator state derives from (:meth:`take` reads it off the global generator).
    ``rank``: this process's rank, mixed into every region, so ranks holding different tokens of one sequence
    (sequence parallelism) draw different masks. ``device``: whose CUDA generator a region also sets.
    """

    def __init__(self, seed: int, device: torch.device | None = None, rank: int = 0):
        self.seed = seed
        self.rank = rank
        self.device = device if device is not None and device.type == "cuda" else None
        self.regions = 0  # regions entered (tests count them)
        self.drew = False  # whether a region drew anything from the generators it set
        self.advanced = False

    @classmethod
    def take(cls, device: torch.device | None = None) -> "Draws":
        """A new forward's draws: the seed read off the global CPU generator's state (which is left as it is), the
        rank from ``torch.distributed`` when it is initialised."""
        state = torch.get_rng_state().numpy().tobytes()
        seed = int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") & _MASK
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() \
            else 0
        return cls(seed, device, rank)

    def advance(self) -> None:
        """After the forward (not its replays): if a region drew, advance the global CPU generator by one draw, once,
        so the next forward (and the next module's :meth:`take`) starts from another state."""
        if self.drew and not self.advanced:
            self.advanced = True
            torch.randint(0, 2, ())

    @contextlib.contextmanager
    def region(self, *key: int) -> Iterator[None]:
        """Within: the global generators start from the state of region ``key`` (e.g. a chunk's first token);
        on exit they are restored to what they were."""
        self.regions += 1
        seed = _mix(self.seed, self.rank, *key)
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            if self.device is not None:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(seed)
            start = self._states()
            yield
            if not self.drew and not all(torch.equal(a, b) for a, b in zip(start, self._states(), strict=True)):
                self.drew = True

    def _states(self) -> list[torch.Tensor]:
        """The states of the generators a region sets (CPU, and the CUDA device's)."""
        states = [torch.get_rng_state()]
        if self.device is not None:
            states.append(torch.cuda.get_rng_state(self.device))
        return states
