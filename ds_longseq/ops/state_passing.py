"""Recurrent states passed rank to rank along a sequence-parallel group.

Holds:
    StateRing: sends a recurrent mixer's states (a dict of tensors, ``ops.carried_state``) from rank p to
        rank p+1 of the group in forward, and their gradients from p+1 back to p in backward.

Why: under sequence parallelism rank p holds tokens [p*T_l, (p+1)*T_l). A linear-attention, state-space or
short-convolution layer on those tokens must start from the state the tokens before leave (rank p-1's
final state), exactly as StreamBP's chunk c starts from chunk c-1's: the group is one more level of the
same chunk chain. The price: a recurrent layer runs on the ranks one after the other (rank p waits for
p-1 in forward and for p+1 in backward), so it is not faster on P ranks, only P times smaller per rank.

Point-to-point through ``torch.distributed`` on the group (gloo or NCCL); the states' keys, shapes and
dtypes go first as a small object, so the receiver needs no template. Both sides stage that object on the
device of the layer input they pass (the current CUDA device for NCCL), so they agree even when a side has
no state to send.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["StateRing"]


class StateRing:
    """The sequence-parallel group as a chain p-1 -> p -> p+1 for recurrent states.

    Args:
        group: the sequence-parallel process group.
    """

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.prev = None if self.rank == 0 else dist.get_global_rank(group, self.rank - 1)
        self.next = None if self.rank == self.size - 1 else dist.get_global_rank(group, self.rank + 1)

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

    def from_previous(self, device: torch.device) -> dict:
        """The states rank p-1 ended with ({} on the first rank): this rank's first chunk starts from them."""
        return self._recv(self.prev, device)

    def to_next(self, states: dict, device: torch.device) -> None:
        """Send the states this rank ended with to rank p+1 (nothing on the last rank)."""
        self._send(states, self.next, device)

    def grads_from_next(self, device: torch.device) -> dict:
        """The gradient of the states this rank ended with, sent back by rank p+1 ({} on the last rank)."""
        return self._recv(self.next, device)

    def grads_to_previous(self, grads: dict, device: torch.device) -> None:
        """Send the gradient of the states this rank started from to rank p-1 (nothing on the first rank)."""
        self._send(grads, self.prev, device)


def _object_device(device: torch.device) -> torch.device | None:
    """Where ``send_object_list`` stages its bytes: the current CUDA device for a layer on CUDA (NCCL), else the
    CPU (None)."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None
