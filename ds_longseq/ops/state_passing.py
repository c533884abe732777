"""Recurrent states passed rank to rank along a sequence-parallel group.

Holds:
    StateRing: sends a recurrent mixer's states (a dict of tensors, ``ops.carried_state``) from rank p to
        rank p+1 of the group in forward, and their gradients from p+1 back to p in backward; under Ulysses x
        ring from each run of a rank's tokens to the rank holding the next run.

Why: under sequence parallelism rank p holds tokens [p*T_l, (p+1)*T_l). A linear-attention, state-space or
short-convolution layer on those tokens must start from the state the tokens before leave (rank p-1's
final state), exactly as StreamBP's chunk c starts from chunk c-1's: the group is one more level of the
same chunk chain. Under a ring a rank's tokens are two runs of the sequence, each its own link of the chain
(``StateRing.local_spans``; StreamBP's chunks never cross one's end). The price: a recurrent layer runs on the
ranks one after the other (rank p waits for p-1 in forward and for p+1 in backward), so it is not faster on P
ranks, only P times smaller per rank.

Point-to-point through ``torch.distributed`` on the group (gloo or NCCL); the states' keys, shapes and
dtypes go first as a small object, so the receiver needs no template. Both sides stage that object on the
device of the layer input they pass (the current CUDA device for NCCL), so they agree even when a side has
no state to send.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_longseq.ops.sp_positions import position_runs

__all__ = ["StateRing"]


class StateRing:
    """The sequence-parallel group as a chain of segments for recurrent states.

    Under Ulysses alone rank p holds one segment, tokens [p T_l, (p + 1) T_l): its states come from rank p - 1 and go
    to rank p + 1. Under Ulysses x ring (``ops.sp_layout``) a rank's tokens are runs of consecutive positions (two
    zigzag blocks' parts): each run is a segment, continuing from the rank that holds the position before it and
    handing on to the rank that holds the position after it. Every rank walks its segments in sequence order
    (forward) or in reverse (backward), sending before it receives, so the chain runs once through the group.

    Args:
        group: the sequence-parallel process group.
        positions: (P, T_l) the global positions of every rank's tokens (``ops.sp_positions.sp_positions``), or None
            for Ulysses' contiguous shards.
    """

    def __init__(self, group, positions: torch.Tensor | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if positions is None:
            self.starts = [0]
            self.prev = [None if self.rank == 0 else self.rank - 1]
            self.next = [None if self.rank == self.size - 1 else self.rank + 1]
        else:
            self.starts, self.prev, self.next = _segments(positions, self.rank)
        self.prev = [None if r is None else dist.get_global_rank(group, r) for r in self.prev]
        self.next = [None if r is None else dist.get_global_rank(group, r) for r in self.next]

    def local_spans(self, local_len: int) -> list[tuple[int, int]]:
        """[(start, end)] of this rank's segments in its local shard of ``local_len`` tokens, in sequence order."""
        return list(zip(self.starts, [*self.starts[1:], local_len], strict=True))

    def _send(self, states: dict, dst: int | None, device: torch.device) -> None:
        if dst is None:
            return
        meta = [[(key, tuple(t.shape), t.dtype) for key, t in sorted(states.items())]]
        dist.send_object_list(meta, dst=dst, group=self.group, device=_object_device(device))
        for _, t in sorted(states.items()):
            dist.send(t.detach().contiguous(), dst=dst, group=self.group)

    def _recv(self, src: int | None, device: torch.device) -> dict:
        if src is None:
            return {}
        meta = [None]
        dist.recv_object_list(meta, src=src, group=self.group, device=_object_device(device))
        out = {}
        for key, shape, dtype in meta[0]:
            out[key] = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(out[key], src=src, group=self.group)
        return out

    def from_previous(self, device: torch.device, segment: int = 0) -> dict:
        """The states the segment before ``segment`` ended with ({} at the sequence's start)."""
        return self._recv(self.prev[segment], device)

    def to_next(self, states: dict, device: torch.device, segment: int = 0) -> None:
        """Send the states ``segment`` ended with on (nothing at the sequence's end)."""
        self._send(states, self.next[segment], device)

    def grads_from_next(self, device: torch.device, segment: int = 0) -> dict:
        """The gradient of the states ``segment`` ended with, sent back by the next segment's rank ({} at the end)."""
        return self._recv(self.next[segment], device)

    def grads_to_previous(self, grads: dict, device: torch.device, segment: int = 0) -> None:
        """Send the gradient of the states ``segment`` started from back (nothing at the sequence's start)."""
        self._send(grads, self.prev[segment], device)


def _segments(positions: torch.Tensor, rank: int) -> tuple[list[int], list, list]:
    """([local start], [previous owner], [next owner]) of ``rank``'s runs of consecutive positions (group ranks;
    None at the sequence's start / end)."""
    owner = torch.empty(positions.numel(), dtype=torch.int64)
    owner[positions.flatten()] = torch.arange(positions.shape[0]).repeat_interleave(positions.shape[1])
    runs = position_runs(positions[rank])
    total = positions.numel()
    prev = [None if first == 0 else int(owner[first - 1]) for _, _, first in runs]
    nxt = [None if first + hi - lo == total else int(owner[first + hi - lo]) for lo, hi, first in runs]
    return [lo for lo, _, _ in runs], prev, nxt


def _object_device(device: torch.device) -> torch.device | None:
    """Where ``send_object_list`` stages its bytes: the current CUDA device for a layer on CUDA (NCCL), else the
    CPU (None)."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None
