"""Sequence-parallel set-up for the engine and the batch sharding helper for training loops.

Holds:
    shard_batch: cut a batch along the sequence for one rank of a sequence-parallel group, with the
        labels shifted once over the whole sequence first, by the layout of the model (or engine) it is for.
    sp_layout_of: the ``ops.sp_layout.SPLayout`` an enabled model (or the DeepSpeed engine around one) runs.
    sequence_parallel_groups: DeepSpeed's ``parallel_state_sp`` (its ``mpu``), initialised for P ranks.
    sequence_parallel_rank_and_size: this rank's place in its group (DeepSpeed's groups).
    shard_sequence / sequence_from_shards: cut one per-position tensor like shard_batch; put the group's shards of one
        (an all-gather's concatenation) back in the sequence's order.
    WholeSequenceCalls: while active, fused-LM-head calls with whole sequences (the same on every rank of a group)
        run sharded across the group and return whole-sequence per-token outputs (TRL's DPO and GRPO trainers); with
        ``whole_logits``, calls without labels return the whole sequence's logits (TRL 1.9's).

Shape legend: B batch, T global length, P ranks per sequence, T_l = T / P.

Groups are DeepSpeed's own (``deepspeed.runtime.sequence_parallel.parallel_state_sp``): ranks
[g*P, (g+1)*P) share a sequence; ZeRO partitions and reduces over the whole world, and DeepSpeed
averages gradients over the world / P data-parallel replicas.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ds_longseq.compat import deepspeed_sp_group
from ds_longseq.ops.documents import PACKED_KWARGS, find_documents, mask_document_starts
from ds_longseq.ops.objectives import gather_sequence
from ds_longseq.ops.sp_layout import SPLayout, length_unit
from ds_longseq.ops.sp_positions import sp_positions
from ds_longseq.patch import sequence_parallel_of
from ds_longseq.processes.process_group import ensure_process_group

__all__ = [
    "WholeSequenceCalls", "data_parallel_rank_and_size", "shard_batch", "shard_sequence", "sequence_from_shards",
    "sequence_parallel_groups", "sequence_parallel_rank_and_size", "sp_layout_of",
]

_SEQ_KEYS = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids")
SHARDED_KEYS = frozenset(_SEQ_KEYS) | frozenset(PACKED_KWARGS)
"""Batch keys :func:`shard_batch` takes (the packed-document kwargs are turned into position ids)."""


def sequence_parallel_groups(size: int):
    """DeepSpeed's ``parallel_state_sp`` module with its groups built for ``size`` ranks per sequence.

    The world's process group is adopted (accelerate's, the user's) or started from the launcher's environment
    (:func:`~ds_longseq.processes.process_group.ensure_process_group`); with neither, ``size`` > 1 is refused naming
    the launch commands. Building twice with the same size reuses the groups. The ranks against the size: the
    resolver's rule (``sequence_parallel.divides_world``), which every entry point runs before this (DeepSpeed's own
    RuntimeError for a direct call with a size that does not divide them).
    """
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    ensure_process_group(size)
    if deepspeed_sp_group() is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    elif mpu.get_sequence_parallel_world_size() != size:
        raise ValueError(
            f"DeepSpeed's sequence-parallel groups already exist with size {mpu.get_sequence_parallel_world_size()}, "
            f"not {size}: one process can train with one sequence_parallel size"
        )
    return mpu


def data_parallel_rank_and_size(sp_size: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(this rank's data-parallel replica, number of replicas) when every ``sp_size`` consecutive ranks share a
    sequence: replicas are ``world / sp_size`` groups of consecutive ranks (DeepSpeed's ``parallel_state_sp``
    layout). ``rank`` / ``world`` default to torch.distributed's (0 / 1 without a process group)."""
    import torch.distributed as dist

    if rank is None or world is None:
        initialized = dist.is_initialized()
        rank = (dist.get_rank() if initialized else 0) if rank is None else rank
        world = (dist.get_world_size() if initialized else 1) if world is None else world
    return rank // sp_size, world // sp_size


def sequence_parallel_rank_and_size() -> tuple[int, int]:
    """(rank in the sequence-parallel group, group size) from DeepSpeed's groups; (0, 1) if there are none."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    if deepspeed_sp_group() is None:
        return 0, 1
    return mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()


def sp_layout_of(model: torch.nn.Module) -> SPLayout | None:
    """The layout (``ops.sp_layout.SPLayout``) an enabled model runs, also read through the DeepSpeed engine around it
    (``engine.module``) or a PEFT wrapper; None for a model without sequence parallelism."""
    sp = sequence_parallel_of(model)
    inner = getattr(model, "module", None)
    if sp is None and isinstance(inner, torch.nn.Module):
        sp = sequence_parallel_of(inner)
    return None if sp is None else sp.layout


def _cut_layout(layout: SPLayout | torch.nn.Module | None, sp_rank: int | None, sp_size: int | None,
                ring: int | None) -> tuple[SPLayout, int, int]:
    """(the layout a batch is cut by, this rank, P) from :func:`shard_batch`'s arguments."""
    if isinstance(layout, torch.nn.Module):
        model, layout = layout, sp_layout_of(layout)
        if layout is None:
            raise ValueError(f"shard_batch(layout=<{type(model).__name__}>): the model is not enabled with sequence "
                             "parallelism (long_seq.sequence_parallel): pass the model or engine the batch is for")
    if sp_rank is None or sp_size is None:
        has_group = layout is not None and layout.group is not None
        sp_rank, sp_size = (layout.rank, layout.size) if has_group else sequence_parallel_rank_and_size()
    if layout is None:
        return SPLayout(sp_size, 1 if ring is None else ring), sp_rank, sp_size
    if layout.size != sp_size or ring not in (None, layout.ring):
        raise ValueError(
            f"shard_batch(sp_size={sp_size}, ring={ring}) for a model run as Ulysses x ring {layout.ulysses} x "
            f"{layout.ring} on {layout.size} ranks: leave sp_size and ring out, the layout gives them"
        )
    return layout, sp_rank, sp_size


def shard_batch(
    batch: Mapping[str, Any],
    sp_rank: int | None = None,
    sp_size: int | None = None,
    *,
    layout: SPLayout | torch.nn.Module | None = None,
    pad: bool = False,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    ring: int | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's 1/P of every sequence in ``batch``, ready for the model under sequence parallelism.

    Labels are shifted once over the whole sequence (``shift_labels[t] = labels[t + 1]``, the last
    one ignored) and then cut like the inputs, so no label is lost at a shard boundary. Position
    ids default to the global ``arange(T)`` (what the stock model uses) and are cut too.

    Packed rows (several documents per row, no ``attention_mask``) keep their restarting
    ``position_ids`` (the model finds every document's global boundaries from them, so a document
    may span ranks); the varlen form (``cu_seq_lens_q/k``) is turned into such position ids. The
    last token of a document is never trained to predict the next document's first token. With
    ``pad=True`` the padding tail of a packed row is one more document (labels ignored).

    Args:
        batch: (B, T) ``input_ids`` and optionally ``attention_mask``, ``labels`` (or already-shifted
            ``shift_labels``), ``position_ids`` ((B or 1, T)) and the varlen kwargs
            ``cu_seq_lens_q/k``, ``max_length_q/k``. Other keys are refused.
        sp_rank, sp_size: this rank's place in its group; default: the layout's group, else DeepSpeed's groups.
        layout: how the group holds the sequence: the enabled model the batch is for, or the DeepSpeed engine
            around it (:func:`sp_layout_of`), or an ``ops.sp_layout.SPLayout``. Under Ulysses x ring (ring degree
            r > 1) rank p then holds the tokens ``ops.sp_positions.sp_positions`` gives it (part of its ring rank's
            zigzag shard, not a contiguous slice), its position ids those tokens' global positions. None: Ulysses
            alone, contiguous slices (or as ``ring`` says).
        pad: when T is not a multiple of P (of 2 P with a ring), pad on the right to the next multiple
            (``pad_token_id``, mask 0, label ``ignore_index``); causal attention makes right padding exact. Without
            it, such a T is an error.
        pad_token_id: token id used for that padding.
        ignore_index: the label value that is not trained on.
        ring: an alias kept for one release (before ``layout``): ``ring=r`` cuts as ``layout=SPLayout(P, ring=r)``;
            beside ``layout`` it must be the layout's.

    Returns:
        ``input_ids``, ``position_ids``, and ``attention_mask`` / ``shift_labels`` when given, each (B, T/P).
    """
    layout, sp_rank, sp_size = _cut_layout(layout, sp_rank, sp_size, ring)
    unknown = sorted(set(batch) - set(_SEQ_KEYS) - set(PACKED_KWARGS))
    if unknown:
        raise ValueError(f"shard_batch does not know how to cut {unknown}: pass only {list(_SEQ_KEYS)}")
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs input_ids")
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("give labels or shift_labels, not both")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(ids.shape)}")
    B, T = ids.shape
    for key in ("attention_mask", "labels", "shift_labels"):
        if key in batch and tuple(batch[key].shape) != (B, T):
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)}, expected {(B, T)} like input_ids")
    out: dict[str, torch.Tensor] = {"input_ids": ids}
    if "attention_mask" in batch:
        out["attention_mask"] = torch.as_tensor(batch["attention_mask"])
    pos = None
    if "position_ids" in batch:
        pos = torch.as_tensor(batch["position_ids"])
        if pos.dim() != 2 or pos.shape[-1] != T or pos.shape[0] not in (1, B):
            raise ValueError(f"position_ids has shape {tuple(pos.shape)}, expected (1 or {B}, {T})")
    # the varlen form becomes restarting positions, which carry the documents across ranks
    doc_start, pos = find_documents(
        pos, out.get("attention_mask"), B, T, batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    )
    if "labels" in batch:
        labels = mask_document_starts(torch.as_tensor(batch["labels"]), doc_start, ignore_index)
        out["shift_labels"] = torch.cat([labels[:, 1:], labels.new_full((B, 1), ignore_index)], dim=1)
    elif "shift_labels" in batch:
        out["shift_labels"] = torch.as_tensor(batch["shift_labels"])
    out["position_ids"] = pos if pos is not None else torch.arange(T, device=ids.device).unsqueeze(0)
    ring, unit = layout.ring, layout.length_unit
    remainder = T % unit
    if remainder:
        if not pad:
            what = f"sequence_parallel size {sp_size}" if ring == 1 else f"2 x sequence_parallel size {sp_size} (ring)"
            raise ValueError(
                f"sequence length {T} is not divisible by {what}: pad to "
                f"{T + unit - remainder} tokens, or call shard_batch(..., pad=True)"
            )
        extra = unit - remainder
        if "attention_mask" not in out and doc_start is None:
            out["attention_mask"] = torch.ones_like(ids)
        pos = out["position_ids"]
        if doc_start is None:
            tail = pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)
        else:  # packed: the padding is one more document (a mask would hide the documents from transformers)
            tail = torch.arange(extra, device=pos.device).expand(pos.shape[0], extra)
        out["position_ids"] = torch.cat([pos, tail], dim=1)
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "shift_labels": ignore_index}
    return {k: shard_sequence(v, sp_rank, sp_size, fill.get(k, 0), ring=ring) for k, v in out.items()}


def shard_sequence(tensor: torch.Tensor, sp_rank: int, sp_size: int, fill: int | float = 0,
                   ring: int | None = None) -> torch.Tensor:
    """Rank ``sp_rank``'s 1/P of ``tensor`` (B, T, ...) along the sequence, T first padded on the right to a multiple
    of P (2 P with a ``ring`` degree above 1) with ``fill``: the cut :func:`shard_batch` makes, for any per-position
    tensor that must line up with its shards (e.g. per-target metadata). A contiguous slice (``ring`` None or 1), or
    with a ring the tokens ``ops.sp_positions.sp_positions`` gives the rank (the model's ring degree:
    ``sp_layout_of(model).ring``)."""
    ring = 1 if ring is None else ring
    extra = -tensor.shape[1] % length_unit(sp_size, ring)
    if extra:
        tensor = torch.cat([tensor, tensor.new_full((tensor.shape[0], extra, *tensor.shape[2:]), fill)], dim=1)
    local = tensor.shape[1] // sp_size
    if ring == 1:
        return tensor[:, sp_rank * local:(sp_rank + 1) * local].contiguous()
    positions = sp_positions(tensor.shape[1], sp_size // ring, ring)[sp_rank].to(tensor.device)
    return tensor[:, positions].contiguous()


def sequence_from_shards(gathered: torch.Tensor, sp_size: int, ring: int) -> torch.Tensor:
    """(B, T, ...) in the sequence's order, from ``gathered``: the P ranks' (B, T / P, ...) shards side by side in
    rank order (an all-gather's concatenation), each cut by :func:`shard_sequence` with ``ring``; its inverse (T
    the padded length). The identity without a ring (contiguous shards); under a ring each rank's tokens go back to
    the global positions ``ops.sp_positions.sp_positions`` gave it. Differentiable (an index: the gradient goes back
    to the shard each value came from)."""
    if ring == 1:
        return gathered
    positions = sp_positions(gathered.shape[1], sp_size // ring, ring).flatten().to(gathered.device)
    return gathered[:, torch.argsort(positions)]  # position k sits at index argsort(positions)[k] of the gather


# the per-token fields of a fused-LM-head output (TRL's FusedCausalLMOutput, ds_longseq's FusedLMHeadOutput)
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class WholeSequenceCalls:
    """Context inside which the fused-LM-head calls of ``modules`` take whole sequences under sequence parallelism.

    For a caller whose loss is a function of whole-sequence sums of per-token log-probs (TRL's DPO trainer: each
    completion's log-likelihood) and that calls ``model(input_ids=..., attention_mask=..., labels=...,
    fused_lm_head=True)`` itself. Every rank of a sequence-parallel group holds the same whole (B, T) batch; each
    such call is cut here (:func:`shard_batch`, padded to a multiple of P), runs on this rank's 1/P (the module's
    forward must be ds_longseq's, enabled with sequence parallelism over ``group``), and its per-token outputs are
    gathered back along the sequence (:func:`~ds_longseq.ops.objectives.gather_sequence`) to (B, T - 1), as
    TRL's own head returns them. So the caller computes its whole loss and metrics on every rank; each rank's
    gradient is that of its own slice, and the ranks' gradients summed (DeepSpeed's reduction) are the loss's.

    With ``whole_logits``, a call without labels (``model(input_ids=..., attention_mask=...)``, TRL 1.9's DPO and
    GRPO, which read ``outputs.logits``) is cut the same way and its (B, T_l, V) logits gathered back to the whole
    (B, T, V) (``logits_to_keep`` applied to the whole sequence afterwards): exact, with the gradient of each rank's
    own slice as above, but every rank then holds the whole sequence's logits, as the caller's own forward would.

    Args:
        modules: the modules the caller calls (a PEFT wrapper, the causal LM), each hooked once.
        rank, size, group: this rank's place in its sequence-parallel group, and the group.
        ring: the ring degree the calls are cut by; None: the modules' (the layout of the models enabled among them,
            :func:`sp_layout_of`; 1 when none is).
        whole_logits: also take calls without labels, their logits made whole.

    Raises:
        ValueError: modules enabled with different ring degrees, or a ``ring`` other than theirs.

    Raises (from a call inside the context):
        ValueError: a call that is not a fused-LM-head call with ``labels=`` (or with ``whole_logits`` a call without
            labels) and keyword inputs (its outputs could not be made whole), or a batch key :func:`shard_batch` cannot
            cut.
    """

    def __init__(self, modules: Iterable[torch.nn.Module], rank: int, size: int, group, ring: int | None = None,
                 whole_logits: bool = False):
        self.modules = list({id(m): m for m in modules}.values())
        enabled = {layout.ring for layout in map(sp_layout_of, self.modules) if layout is not None} or {1}
        ring = next(iter(enabled)) if ring is None and len(enabled) == 1 else ring
        if enabled != {ring}:  # the calls would be cut in one layout and attended in another
            raise ValueError(
                f"WholeSequenceCalls(ring={ring}) under sequence parallelism {size}, but the modules run ring degree "
                f"{' and '.join(map(str, sorted(enabled)))}: pass modules of one layout, with ring left unset"
            )
        self.rank, self.size, self.group, self.ring = rank, size, group, ring
        self.whole_logits = whole_logits
        self._handles: list = []
        # the calls under way (innermost last): (whole T, None for a fused call or the logits_to_keep of a logits call)
        self._calls: list[tuple[int, int | None]] = []

    def __enter__(self) -> "WholeSequenceCalls":
        if self._handles:
            raise RuntimeError("WholeSequenceCalls is already active")
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._cut, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._join, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._calls.clear()

    def _cut(self, module, args, kwargs):
        fused = bool(kwargs.get("fused_lm_head")) and kwargs.get("labels") is not None
        logits = (self.whole_logits and not kwargs.get("fused_lm_head") and kwargs.get("labels") is None
                  and kwargs.get("shift_labels") is None)
        keep = kwargs.pop("logits_to_keep", 0) if logits else 0
        if args or not (fused or logits) or not isinstance(keep, int):
            also = " or a call without labels (its logits)" if self.whole_logits else ""
            raise ValueError(
                f"{type(module).__name__} called under sequence parallelism with whole sequences, but not as a "
                f"fused-LM-head call (model(input_ids=..., labels=..., fused_lm_head=True), keyword arguments){also}: "
                "only those calls' outputs can be made whole again. Compute logits with sequence parallelism "
                "paused (trainer.sequence_parallel_paused())"
            )
        seq = {k: kwargs.pop(k) for k in list(kwargs) if k in SHARDED_KEYS and kwargs[k] is not None}
        kwargs.pop("seq_idx", None)  # see trainer.batches.shard_inputs: documents come from the restarting positions
        self._calls.append((int(seq["input_ids"].shape[1]), keep if logits else None))
        kwargs.update(shard_batch(seq, self.rank, self.size, pad=True, ring=self.ring))
        return args, kwargs

    def _join(self, module, args, kwargs, output):
        length, keep = self._calls.pop()
        if keep is not None:  # a call without labels: (B, T, V) logits, cut to the last logits_to_keep (0: all)
            whole = gather_sequence(output.logits, self.group, self.rank, self.size)
            start = max(length - keep, 0) if keep else 0
            output["logits"] = sequence_from_shards(whole, self.size, self.ring)[:, start:length]
            return output
        length -= 1  # labels= calls score positions 0 .. T - 2 (the next token)
        for name in _PER_TOKEN_FIELDS:
            value = getattr(output, name, None)
            if isinstance(value, torch.Tensor):
                whole = gather_sequence(value, self.group, self.rank, self.size)  # (B, T padded), rank after rank
                output[name] = sequence_from_shards(whole, self.size, self.ring)[:, :length]
        return output
