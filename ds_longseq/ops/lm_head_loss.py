"""Chunked LM head + causal-LM cross entropy that never materialises (B x T x V) logits.

Holds:
    shift_causal_labels: HF's label shift (pad with ignore_index, drop the first position).
    chunked_lm_head_loss: (loss_sum, num_valid) over valid tokens, chunk by chunk.

Shape legend: B batch, T sequence, d hidden, V vocab, N valid tokens, C chunk.

Forward computes logits one chunk of valid tokens at a time under no_grad and sums the float32
cross entropy; backward recomputes each chunk's logits and forms dLogits = softmax - onehot in
place. Only the hidden states, the weight and the targets are saved: one (C x V) chunk of logits
exists at a time, in forward and in backward (StreamBP Sec. 3.2.1, MsT Alg. 2).

The numerics follow transformers' ``ForCausalLMLoss``: logits are computed in the model dtype and
upcast to float32 before the softmax (float64 models stay in float64, where transformers would
round to float32: exactness tests then reach 1e-10 against a float64 reference). Tokens whose
target is ``ignore_index`` are skipped entirely, so they cost no FLOPs. The op returns a SUM and a
COUNT: callers divide once by the global number of valid tokens (or ``num_items_in_batch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_longseq.ops.chunk_grads import acc_dtype

__all__ = ["shift_causal_labels", "chunked_lm_head_loss"]


def shift_causal_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts labels[t + 1]; the last predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cross_entropy_sum_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum_i (logsumexp(logits_i) - logits_i[t_i]), overwriting ``logits`` (C, V): one C x V buffer,
    where ``F.cross_entropy`` would allocate a second one for its log-softmax."""
    target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    row_max = logits.amax(dim=-1, keepdim=True)
    sum_exp = logits.sub_(row_max).exp_().sum(dim=-1)
    return (sum_exp.log_() + row_max.squeeze(1) - target_logits).sum()


class _ChunkedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, index, targets, chunk_size):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        total = torch.zeros((), dtype=_loss_dtype(hidden.dtype), device=hidden.device)
        with torch.no_grad():
            for s in range(0, index.numel(), chunk_size):
                idx = index[s : s + chunk_size]
                total += _cross_entropy_sum_(F.linear(h2.index_select(0, idx), weight, bias).to(total.dtype),
                                             targets[s : s + chunk_size])
        ctx.save_for_backward(hidden, weight, bias, index, targets)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, index, targets = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h2 = hidden.reshape(-1, hidden.shape[-1])
        acc = acc_dtype(weight.dtype)
        dh = torch.zeros_like(h2) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, index.numel(), chunk_size):
            idx = index[s : s + chunk_size]
            h_c = h2.index_select(0, idx)
            # dLogits = (softmax - onehot) * grad, all in place on one (C x V) buffer
            # (torch.softmax / logsumexp / a plain multiply would each allocate a second one).
            dlogits = F.linear(h_c, weight, bias).to(_loss_dtype(hidden.dtype))
            dlogits.sub_(dlogits.amax(dim=-1, keepdim=True)).exp_()
            dlogits.div_(dlogits.sum(dim=-1, keepdim=True))
            dlogits[torch.arange(idx.numel(), device=idx.device), targets[s : s + chunk_size]] -= 1.0
            dlogits.mul_(grad_total)
            # Cast like the backward of HF's `logits.float()`: the gradient reaches the matmuls in
            # the model dtype (a copy only for half-precision models).
            dlogits = dlogits.to(hidden.dtype)
            if need_h:
                dh.index_copy_(0, idx, dlogits @ weight)
            if need_w:
                dw += dlogits.t() @ h_c
            if need_b:
                db += dlogits.sum(0)
            del dlogits  # free this chunk's logits before the next chunk allocates its own
        return (
            None if dh is None else dh.view_as(hidden),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross entropies of ``hidden @ weight.T (+ bias)`` against ``targets``.

    Args:
        hidden: (B, T, d) final hidden states (after the final norm).
        weight: (V, d) LM-head weight (tied or not).
        targets: (B, T) target ids, already shifted (see :func:`shift_causal_labels`).
        chunk_size: valid tokens per chunk of logits.
        bias: optional (V,) LM-head bias.
        ignore_index: targets equal to this are skipped.

    Returns:
        (loss_sum, num_valid): float32 (float64 for float64 inputs) scalar with autograd history, and
        an int64 scalar tensor.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match hidden states {tuple(hidden.shape[:-1])}"
        )
    flat = targets.reshape(-1).to(hidden.device)
    index = (flat != ignore_index).nonzero().squeeze(-1)
    num_valid = torch.tensor(index.numel(), device=hidden.device)
    loss_sum = _ChunkedLMHeadLoss.apply(hidden, weight, bias, index, flat.index_select(0, index), int(chunk_size))
    return loss_sum, num_valid
