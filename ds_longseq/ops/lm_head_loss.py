"""Chunked LM head + causal-LM cross entropy that never materialises (B x T x V) logits.

Holds:
    shift_causal_labels: HF's label shift (pad with ignore_index, drop the first position).
    softcap_logits: final-logit softcapping, ``cap * tanh(logits / cap)`` (Gemma 2).
    chunked_lm_head_loss: (loss_sum, num_valid) over valid tokens, chunk by chunk.
    chunked_token_logprobs: (B, T) per-token log-probabilities (and entropies) of given targets,
        chunk by chunk, for objectives built on them (DPO, GRPO).
    chunked_token_outputs: the same with every per-token statistic of TRL's fused LM head
        (entropy, top-1 flag, mean logit, log sum_v p_v^2) and a sampling temperature.
    TokenHeadOutputs: what ``chunked_token_outputs`` returns.

Shape legend: B batch, T sequence, d hidden, V vocab, N valid tokens, C chunk.

Forward computes logits one chunk of valid tokens at a time under no_grad and sums the float32
cross entropy. In training the loss's forward also forms its gradient while each chunk's logits exist
(dLogits = softmax - onehot in place, then the input, weight and bias products, as Liger's fused linear
cross entropy does): the loss is a sum, so backward only multiplies the upstream scalar in, and the logits
are computed once per step (HF's count) instead of twice. It keeps the (B, T, d) input gradient in place of
the hidden states, and the weight's (V, d) gradient from the forward on (allocated in backward before). The
per-token outputs (DPO, GRPO) get a different upstream gradient per token: their backward recomputes each
chunk's logits. One (C x V) chunk of logits exists at a time, in forward and in backward (StreamBP Sec.
3.2.1, MsT Alg. 2).

The numerics follow transformers' ``ForCausalLMLoss``: logits are computed in the model dtype (the
autocast dtype under autocast, as the stock head's linear) and upcast to float32 before the
softmax (float64 models stay in float64, where transformers would round to float32: exactness
tests then reach 1e-10 against a float64 reference). Tokens whose target is ``ignore_index`` are
skipped entirely, so they cost no FLOPs. The op returns a SUM and a COUNT: callers divide once by
the global number of valid tokens (or ``num_items_in_batch``).

The weight gradient is accumulated over chunks in float32 (the model dtype for float32/float64),
in place, with no per-chunk (V x d) temporary: half-precision chunk shares are never rounded.

Final-logit softcapping (Gemma 2: ``logits = cap * tanh(logits / cap)`` after the head, in the
loss dtype here) is applied per chunk in forward and differentiated exactly in backward, which then
holds a second (C x V) buffer for the chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ds_longseq.ops.chunk_grads import acc_dtype, autocast_dtype
from ds_longseq.ops.phases import phase

__all__ = [
    "shift_causal_labels",
    "softcap_logits",
    "chunked_lm_head_loss",
    "chunked_token_logprobs",
    "chunked_token_outputs",
    "TokenHeadOutputs",
    "TOKEN_HEAD_OUTPUTS",
]


def shift_causal_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts labels[t + 1]; the last predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def softcap_logits(logits: torch.Tensor, cap: float, *, inplace: bool = False) -> torch.Tensor:
    """Final-logit softcapping, ``cap * tanh(logits / cap)``, with the stock forwards' ops in their
    order (Gemma 2's ``final_logit_softcapping``): the same logits give the same bits.

    Args:
        logits: (..., V) logits.
        cap: the softcap, > 0.
        inplace: overwrite ``logits`` (no second (..., V) buffer; only outside autograd, whose
            tanh backward needs its output unchanged) and return it.
    """
    if inplace:
        return logits.div_(cap).tanh_().mul_(cap)
    return torch.tanh(logits / cap) * cap


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cross_entropy_sum_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum_i (logsumexp(logits_i) - logits_i[t_i]), overwriting ``logits`` (C, V): one C x V buffer,
    where ``F.cross_entropy`` would allocate a second one for its log-softmax."""
    target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    row_max = logits.amax(dim=-1, keepdim=True)
    sum_exp = logits.sub_(row_max).exp_().sum(dim=-1)
    return (sum_exp.log_() + row_max.squeeze(1) - target_logits).sum()


_MIXED_ADDMM_WORKS: dict[torch.device, bool] = {}


def _mixed_addmm_works(device: torch.device) -> bool:
    """Whether ``addmm`` can add half-precision products into a float32 buffer in place on ``device``
    (``aten::addmm.dtype_out``: CUDA in recent torch); probed once on tiny tensors."""
    if device not in _MIXED_ADDMM_WORKS:
        ok = False
        if device.type == "cuda":
            try:
                acc = torch.ones(2, 2, device=device)
                a = torch.ones(2, 3, dtype=torch.bfloat16, device=device)
                torch.ops.aten.addmm.dtype_out(acc, a, a.t(), torch.float32, out=acc)
                ok = bool((acc == 4.0).all())
            except (RuntimeError, NotImplementedError):
                ok = False
        _MIXED_ADDMM_WORKS[device] = ok
    return _MIXED_ADDMM_WORKS[device]


def _add_weight_grad_(dw: torch.Tensor, dl: torch.Tensor, h_c: torch.Tensor, scratch: torch.Tensor) -> None:
    """``dw += dl.T @ h_c`` with the products summed in ``dw``'s dtype, in place.

    ``dw`` (V, d) is float32 for half-precision heads; ``dl`` (C, V) and ``h_c`` (C, d) are in the
    head's matmul dtype. ``dw += dl.t() @ h_c`` would round each chunk's (V x d) share to half
    precision in a temporary; here each share is exact in float32 and no (V x d) temporary exists.
    ``scratch`` is the chunk's (C, V) float32 logits buffer, reused where no mixed-dtype GEMM exists.
    """
    if dl.dtype == dw.dtype:
        dw.addmm_(dl.t(), h_c)
    elif _mixed_addmm_works(dw.device):
        torch.ops.aten.addmm.dtype_out(dw, dl.t(), h_c, dw.dtype, out=dw)
    else:  # no mixed-dtype GEMM (CPU): the rounded values, in float32
        scratch.copy_(dl)
        dw.addmm_(scratch.t(), h_c.to(dw.dtype))


class _ChunkedLMHeadLoss(torch.autograd.Function):
    """The summed cross entropy. With ``form_grads`` (training), the forward also forms the gradient of the sum
    with respect to the hidden states, the weight and the bias, chunk by chunk while each chunk's logits exist
    (as Liger's fused linear cross entropy does): the loss is a sum, so its upstream gradient is one scalar,
    which the backward multiplies in. The logits are computed once per step instead of twice, and the backward
    is a scaling. Without it (evaluation) the forward computes the loss alone."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, targets, chunk_size, softcap, logit_scale, form_grads):
        # The dtype the stock head's F.linear runs in: the autocast dtype under autocast (as the
        # stock head under autocast), else the hidden states' dtype. Casts are explicit and autocast
        # is off inside, so forward and backward compute the same logits whatever autocast is doing.
        mm_dtype = autocast_dtype(hidden)
        ctx.chunk_size, ctx.mm_dtype, ctx.softcap, ctx.logit_scale = chunk_size, mm_dtype, softcap, logit_scale
        total = torch.zeros((), dtype=_loss_dtype(hidden.dtype), device=hidden.device)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False), phase("lm_head.forward"):
            if form_grads:
                ctx.grads = _head_grads(ctx, ctx.needs_input_grad[:3], hidden, weight, bias, index, targets,
                                        _dlogits_ce(total))
                return total
            h2 = hidden.reshape(-1, hidden.shape[-1])
            w, b = _cast(weight, mm_dtype), _cast(bias, mm_dtype)
            buf = _logits_buffer(hidden, weight, min(chunk_size, index.numel()), total.dtype)
            for s in range(0, index.numel(), chunk_size):
                idx = index[s : s + chunk_size]
                logits, _ = _chunk_logits(buf, h2.index_select(0, idx).to(mm_dtype), w, b, logit_scale, softcap)
                total += _cross_entropy_sum_(logits, targets[s : s + chunk_size])
                del logits
        ctx.grads = None
        ctx.save_for_backward(hidden, weight, bias, index, targets)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:  # formed in forward unless the forward ran without grad (then nothing needs it)
            hidden, weight, bias, index, targets = ctx.saved_tensors
            with torch.autocast(hidden.device.type, enabled=False), phase("lm_head.backward"):
                grads = _head_grads(ctx, ctx.needs_input_grad[:3], hidden, weight, bias, index, targets,
                                    _dlogits_ce(None, grad_total))
        else:
            grads = _take_formed(ctx, "grads", "chunked LM-head loss")
            with phase("lm_head.backward"):
                grads = _scaled(grads, grad_total)
        return (*grads, None, None, None, None, None, None)


_CONSUMED = object()


def _take_formed(ctx, attr: str, what: str):
    """``ctx.<attr>``, a gradient the forward formed, handed out once (the backward scales it in place)."""
    formed = getattr(ctx, attr)
    setattr(ctx, attr, _CONSUMED)
    if formed is _CONSUMED:
        raise RuntimeError(
            f"a second backward through ds_longseq's {what} (backward(retain_graph=True) twice): the gradient is "
            "formed in the forward and handed out once. Run the forward again"
        )
    return formed


def _scaled(grads, scale: torch.Tensor):
    """Each gradient formed in forward times the upstream gradient, in place (they are handed out once), in the
    dtype it was accumulated in, then cast to its tensor's."""
    return tuple(None if g is None else g.mul_(scale.to(g.dtype)).to(dtype) for g, dtype in grads)


def _dlogits_ce(total: torch.Tensor | None, grad_total: torch.Tensor | None = None):
    """dLoss/dLogits of the summed cross entropy, for :func:`_head_grads`: softmax - onehot, in place on the one
    (C x V) buffer (``torch.softmax`` / a plain multiply would each allocate a second one). With ``total`` (the
    gradient formed in forward) the chunk's loss is added to it on the way, from the same exponentials; with
    ``grad_total`` (a backward) the result is scaled by it."""

    def dlogits(z: torch.Tensor, rows: slice, t: torch.Tensor) -> torch.Tensor:
        ar = torch.arange(z.shape[0], device=z.device)
        if total is not None:
            target_logits = z[ar, t]
            row_max = z.amax(dim=-1, keepdim=True)
            sum_exp = z.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
            total.add_((sum_exp.log().squeeze(1) + row_max.squeeze(1) - target_logits).sum())
            z.div_(sum_exp)
        else:
            _softmax_(z)
        z[ar, t] -= 1.0
        return z if grad_total is None else z.mul_(grad_total)

    return dlogits


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """One (rows, V) buffer every chunk's logits are written into: a fresh (C x V) tensor per chunk costs its
    pages again each time (on CPU a large allocation is new memory the kernel zero-fills on first touch, ~25 ms
    per 1024 x 32000 float32 chunk here, ``benchmarks/profile.py``)."""
    return torch.empty((max(rows, 1), weight.shape[0]), dtype=dtype, device=hidden.device)


def _logits_into(buf: torch.Tensor, h_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(h_c, w, b)`` in the matmul dtype, cast to ``buf``'s dtype, written into ``buf[:C]`` (returned).
    The same values as ``F.linear(...).to(buf.dtype)``: one GEMM straight into the buffer when the dtypes agree,
    else the GEMM's half-precision result copied (and widened) into it."""
    z = buf[: h_c.shape[0]]
    if h_c.dtype != buf.dtype:
        return z.copy_(F.linear(h_c, w, b))
    if b is None:
        return torch.mm(h_c, w.t(), out=z)
    return torch.addmm(b, h_c, w.t(), out=z)


def _chunk_logits(buf: torch.Tensor, h_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, logit_scale: float,
                  softcap: float | None, keep_tanh: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z, tanh): a chunk's (C, V) logits in ``buf``'s dtype (:func:`_logits_into`) with the family's logit scale and
    final softcap applied in place; with ``keep_tanh``, also tanh(z / cap) for the softcap's chain rule (z is then
    a second buffer, ``tanh * cap``), else None."""
    z = _logits_into(buf, h_c, w, b)
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    tanh = None
    if softcap is not None:
        if keep_tanh:
            tanh = z.div_(softcap).tanh_()
            z = tanh * softcap
        else:
            softcap_logits(z, softcap, inplace=True)
    return z, tanh


def _softmax_(z: torch.Tensor) -> torch.Tensor:
    """Row softmax of ``z`` (C, V) in place."""
    z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
    return z.div_(z.sum(dim=-1, keepdim=True))


def _head_grads(ctx, needs, hidden, weight, bias, index, targets, dlogits_fn):
    """Gradients of the chunked head given, per chunk, dLoss/dLogits from ``dlogits_fn``: ((dh, dtype), (dw,
    dtype), (db, dtype)), each None where ``needs`` (hidden, weight, bias) says so; sums kept in float32 for
    half-precision weights, cast to ``dtype`` by the caller.

    ``dlogits_fn(z, rows, t)`` gets the chunk's (C, V) logits ``z`` in the loss dtype (after the
    softcap; it may overwrite them), the slice ``rows`` of the chunk among the valid tokens and their
    targets ``t`` (C,), and returns dLoss/dz (C, V). The softcap's chain rule, the casts and the
    three products (input, weight, bias gradients) are shared by every objective. Called by a backward (the
    logits recomputed) or by a forward that forms its gradient there.
    """
    chunk_size, mm_dtype = ctx.chunk_size, ctx.mm_dtype
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    loss_dtype = _loss_dtype(hidden.dtype)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    acc = acc_dtype(weight.dtype)
    w, b = _cast(weight, mm_dtype), _cast(bias, mm_dtype)
    dh = torch.zeros_like(h2) if need_h else None
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
    buf = _logits_buffer(hidden, weight, min(chunk_size, index.numel()), loss_dtype)
    for s in range(0, index.numel(), chunk_size):
        idx = index[s : s + chunk_size]
        h_c = h2.index_select(0, idx).to(mm_dtype)
        z, tanh = _chunk_logits(buf, h_c, w, b, ctx.logit_scale, ctx.softcap, keep_tanh=True)
        rows = slice(s, s + idx.numel())
        dlogits = dlogits_fn(z, rows, targets[rows])
        if tanh is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
            dlogits.mul_(tanh.mul_(tanh).neg_().add_(1.0))
            del tanh
        if ctx.logit_scale != 1.0:  # d(scale * z) / dz
            dlogits.mul_(ctx.logit_scale)
        # Cast like the backward of HF's `logits.float()`: the gradient reaches the matmuls in the
        # matmul dtype (a copy only for half precision).
        dl = dlogits.to(mm_dtype)
        if need_h:
            dh.index_copy_(0, idx, (dl @ w).to(dh.dtype))
        if need_w:
            _add_weight_grad_(dw, dl, h_c, dlogits)
        if need_b:
            db += torch.sum(dl, 0, dtype=acc)
        del z, dlogits, dl
    return (
        (None if dh is None else dh.view_as(hidden), hidden.dtype),
        (dw, weight.dtype),
        (db, None if bias is None else bias.dtype),
    )


def _head_backward(ctx, hidden, weight, bias, index, targets, dlogits_fn):
    """:func:`_head_grads` for a backward: the gradients in their tensors' dtypes."""
    grads = _head_grads(ctx, ctx.needs_input_grad[:3], hidden, weight, bias, index, targets, dlogits_fn)
    return tuple(None if g is None else g.to(dtype) for g, dtype in grads)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(N,) log p(target) of each valid token under the temperature-scaled distribution, and when
    asked (N,) entropies, (N,) bool "target is a top logit", (N,) mean logits and (N,) log sum_v p_v^2;
    one (C x V) chunk of logits at a time. The last three are statistics without gradient; unrequested
    outputs are empty and cost nothing.

    The upstream gradient is per token, so unlike the loss's the chunk's dLogits cannot be formed in forward,
    and the backward recomputes each chunk's logits. Except with ``form_grads`` (set by the caller only for a
    frozen head in float32 / float64, no entropy: DPO and GRPO with LoRA): the forward then forms each token's
    d logp / dh, a (d,) row, while its logits exist, and the backward scales the rows by their upstream
    gradients (two GEMMs of N x V x d per step instead of three). It holds (B*T, d) rows in place of the hidden
    states. Not for a trainable head (d logp / dW sums per-token products: the upstream gradients are needed
    first), not with the entropy (its gradient would need a second row per token, for the same GEMM count), and
    not in half precision (the rows would be rounded to it before their scaling: one rounding more than stock's
    head)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, targets, chunk_size, softcap, logit_scale, temperature, with_entropy,
                with_top1, with_mean_logits, with_log_sum_sq, form_grads):
        mm_dtype = autocast_dtype(hidden)
        loss_dtype = _loss_dtype(hidden.dtype)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        n = index.numel()
        logps = torch.empty(n, dtype=loss_dtype, device=hidden.device)

        def optional(wanted: bool, dtype=loss_dtype) -> torch.Tensor:
            return torch.empty(n if wanted else 0, dtype=dtype, device=hidden.device)

        entropy, top1 = optional(with_entropy), optional(with_top1, torch.bool)
        mean_logits, log_sum_sq = optional(with_mean_logits), optional(with_log_sum_sq)
        outs = (logps, entropy, top1, mean_logits, log_sum_sq)
        ctx.chunk_size, ctx.mm_dtype, ctx.softcap, ctx.temperature = chunk_size, mm_dtype, softcap, temperature
        ctx.logit_scale = logit_scale
        ctx.token_grads = None
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False), phase("lm_head.forward"):
            if form_grads:
                (rows_grad, _), _, _ = _head_grads(ctx, (True, False, False), hidden, weight, bias, index, targets,
                                                   _dlogits_token_forward(outs, temperature))
                ctx.token_grads = rows_grad
                ctx.save_for_backward(index)
            else:
                w, b = _cast(weight, mm_dtype), _cast(bias, mm_dtype)
                buf = _logits_buffer(hidden, weight, min(chunk_size, n), loss_dtype)
                for s in range(0, n, chunk_size):
                    idx = index[s : s + chunk_size]
                    rows = slice(s, s + idx.numel())
                    z, _ = _chunk_logits(buf, h2.index_select(0, idx).to(mm_dtype), w, b, logit_scale, softcap)
                    if temperature != 1.0:  # after the softcap, as TRL's head and generation's warper scale
                        z.div_(temperature)
                    _token_statistics(z, rows, targets[rows], outs, last_use=True)
                    del z
                ctx.save_for_backward(hidden, weight, bias, index, targets)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(top1, mean_logits, log_sum_sq)
        return logps, entropy, top1, mean_logits, log_sum_sq

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, _grad_top1, _grad_mean_logits, _grad_log_sum_sq):
        if ctx.token_grads is not None:
            return (_scaled_rows(ctx, grad_logps), *(None,) * 13)
        hidden, weight, bias, index, targets = ctx.saved_tensors
        temperature = ctx.temperature

        def dlogits_token(z: torch.Tensor, rows: slice, t: torch.Tensor) -> torch.Tensor:
            # with y = z / T:  d logp_t / dy = onehot_t - p;  dH / dy = -p * (y - sum_v p_v y_v);
            # dL / dz = dL / dy / T
            if temperature != 1.0:
                z = z.div_(temperature)
            g_lp = None if grad_logps is None else grad_logps[rows].to(z.dtype).unsqueeze(1)
            g_h = None if grad_entropy is None else grad_entropy[rows].to(z.dtype).unsqueeze(1)
            if g_h is None:  # in place on the one (C x V) buffer
                p = _softmax_(z)
                d = p.mul_(-g_lp)
            else:
                p = torch.softmax(z, dim=-1)
                d = p * (z - (p * z).sum(-1, keepdim=True)) * (-g_h)
                if g_lp is not None:
                    d -= p * g_lp
            if g_lp is not None:
                d[torch.arange(d.shape[0], device=d.device), t] += g_lp.squeeze(1)
            return d.div_(temperature) if temperature != 1.0 else d

        if grad_logps is None and grad_entropy is None:
            return (None,) * 14
        with torch.autocast(hidden.device.type, enabled=False), phase("lm_head.backward"):
            grads = _head_backward(ctx, hidden, weight, bias, index, targets, dlogits_token)
        return (*grads, *(None,) * 11)


def _token_statistics(z: torch.Tensor, rows: slice, t: torch.Tensor, outs, last_use: bool) -> torch.Tensor:
    """Write a chunk's log-probs (and the requested statistics) into ``outs`` = (logps, entropy, top1,
    mean_logits, log_sum_sq) at ``rows``, from its (C, V) temperature-scaled logits ``z``; returns the (C,)
    log-sum-exp. ``last_use``: ``z`` may be overwritten."""
    logps, entropy, top1, mean_logits, log_sum_sq = outs
    lse = torch.logsumexp(z, dim=-1)
    z_target = z.gather(1, t.unsqueeze(1)).squeeze(1)
    logps[rows] = z_target - lse
    if entropy.numel():  # H = lse - sum_v p_v z_v
        entropy[rows] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    if top1.numel():  # ties count: the target is "a" most likely token
        top1[rows] = z_target >= z.amax(dim=-1)
    if mean_logits.numel():
        mean_logits[rows] = z.mean(dim=-1)
    if log_sum_sq.numel():  # log sum_v p_v^2 = logsumexp(2 z) - 2 lse, with no p_v^2 to underflow
        log_sum_sq[rows] = torch.logsumexp(z.mul_(2.0) if last_use else z * 2.0, dim=-1) - 2.0 * lse
    return lse


def _dlogits_token_forward(outs, temperature: float):
    """For :func:`_head_grads` in a forward: the chunk's per-token outputs written into ``outs``, then d logp_t / dz
    for a unit upstream gradient per token (onehot_t - softmax, through the temperature), in place on ``z``."""

    def dlogits(z: torch.Tensor, rows: slice, t: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            z = z.div_(temperature)
        lse = _token_statistics(z, rows, t, outs, last_use=False)
        d = z.sub_(lse.unsqueeze(1)).exp_().neg_()  # -softmax
        d[torch.arange(d.shape[0], device=d.device), t] += 1.0
        return d.div_(temperature) if temperature != 1.0 else d

    return dlogits


def _scaled_rows(ctx, grad_logps: torch.Tensor | None) -> torch.Tensor | None:
    """The input gradient from the per-token rows the forward formed (:class:`_ChunkedTokenLogprobs`): each valid
    token's row times its upstream gradient, in place; handed out once."""
    rows = _take_formed(ctx, "token_grads", "chunked per-token log-probs with a frozen head")
    if grad_logps is None:
        return None
    (index,) = ctx.saved_tensors
    flat = rows.view(-1, rows.shape[-1])
    with phase("lm_head.backward"):
        flat.index_copy_(0, index, flat.index_select(0, index).mul_(grad_logps.to(flat.dtype).unsqueeze(1)))
    return rows


TOKEN_HEAD_OUTPUTS = ("entropy", "top1", "mean_logits", "log_sum_sq_probs")
"""The optional per-token outputs of :func:`chunked_token_outputs` (the log-probs are always computed)."""


class TokenHeadOutputs(NamedTuple):
    """Per-token outputs of the chunked head, (B, T) each, 0 / False where ``mask`` is False; the
    optional ones are None when not requested.

    Attributes:
        log_probs: log p(target) under softmax(logits / temperature), differentiable.
        mask: bool, the target is valid (not ``ignore_index``).
        entropy: entropy of the temperature-scaled next-token distribution, differentiable.
        top1: bool, the target has the largest logit (ties included); no gradient.
        mean_logits: mean over the vocabulary of the temperature-scaled logits (after the softcap);
            no gradient.
        log_sum_sq_probs: log sum_v p_v^2 of the temperature-scaled distribution; no gradient.
    """

    log_probs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def chunked_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    temperature: float = 1.0,
    outputs: tuple[str, ...] | frozenset[str] = (),
    logit_scale: float = 1.0,
) -> TokenHeadOutputs:
    """Per-token log-probabilities of ``targets`` and the requested statistics of each next-token
    distribution, chunked: :func:`chunked_token_logprobs` with every per-token field of TRL's fused
    LM head (``trl.trainer.utils.add_fused_lm_head``) and its temperature.

    Args:
        hidden, weight, targets, chunk_size, bias, ignore_index, softcap, logit_scale: as
            :func:`chunked_lm_head_loss`.
        temperature: the logits (after the softcap) are divided by it before the softmax, > 0; the
            gradients are exact for it.
        outputs: which of :data:`TOKEN_HEAD_OUTPUTS` to compute as well; each is computed inside the
            chunk loop only when requested.

    Returns:
        :class:`TokenHeadOutputs`.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match hidden states {tuple(hidden.shape[:-1])}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    if not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    unknown = set(outputs) - set(TOKEN_HEAD_OUTPUTS)
    if unknown:
        raise ValueError(f"unknown per-token outputs {sorted(unknown)}: choose among {list(TOKEN_HEAD_OUTPUTS)}")
    flat = targets.reshape(-1).to(hidden.device)
    mask = flat != ignore_index
    index = mask.nonzero().squeeze(-1)
    wanted = [name in outputs for name in TOKEN_HEAD_OUTPUTS]
    # the input gradient formed in the forward: training through a frozen full-precision head, no entropy
    # (see _ChunkedTokenLogprobs)
    form_grads = (
        torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
        and not (bias is not None and bias.requires_grad) and "entropy" not in outputs
        and autocast_dtype(hidden) in (torch.float32, torch.float64)
    )
    values = _ChunkedTokenLogprobs.apply(
        hidden, weight, bias, index, flat.index_select(0, index), int(chunk_size),
        None if softcap is None else float(softcap), float(logit_scale), float(temperature), *wanted, form_grads,
    )

    def scatter(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros(flat.shape).index_put((index,), v).view(targets.shape)

    logps, *optional = values
    return TokenHeadOutputs(
        scatter(logps),
        mask.view(targets.shape),
        *(scatter(v) if want else None for v, want in zip(optional, wanted, strict=True)),
    )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    entropy: bool = False,
    top1: bool = False,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token log-probabilities of ``targets`` under ``hidden @ weight.T (+ bias)``, chunked.

    The differentiable core of every objective that is a function of per-token log-probs (DPO,
    GRPO; see ``ops/objectives.py``): no (B, T, V) logits, one (C x V) chunk at a time in forward
    and in backward, exact gradients for any upstream (B, T) gradient. Numerics as
    :func:`chunked_lm_head_loss` (model-dtype matmul, float32 softmax, float64 kept). For a
    temperature and the other statistics of TRL's fused head see :func:`chunked_token_outputs`.

    Args:
        hidden: (B, T, d) final hidden states; weight (V, d); targets (B, T) already shifted.
        chunk_size: valid tokens per chunk of logits.
        bias, ignore_index, softcap, logit_scale: as :func:`chunked_lm_head_loss`.
        entropy: also return the entropy of each valid position's predicted distribution.
        top1: also return whether each valid target has the largest logit (ties included; for
            token-accuracy metrics, no gradient).

    Returns:
        (logprobs, mask, entropy, top1): (B, T) float32 (float64 for float64 inputs) log-probs, 0
        where ``mask`` (B, T, bool: target valid) is False; (B, T) entropies likewise, or None;
        (B, T) bool top-1 flags (False where masked), or None.
    """
    out = chunked_token_outputs(
        hidden, weight, targets, chunk_size=chunk_size, bias=bias, ignore_index=ignore_index, softcap=softcap,
        logit_scale=logit_scale, outputs=tuple(name for name, want in (("entropy", entropy), ("top1", top1)) if want),
    )
    return out.log_probs, out.mask, out.entropy, out.top1


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross entropies of ``hidden @ weight.T (+ bias)`` against ``targets``.

    Args:
        hidden: (B, T, d) final hidden states (after the final norm).
        weight: (V, d) LM-head weight (tied or not).
        targets: (B, T) target ids, already shifted (see :func:`shift_causal_labels`).
        chunk_size: valid tokens per chunk of logits.
        bias: optional (V,) LM-head bias.
        ignore_index: targets equal to this are skipped.
        softcap: final-logit softcapping (``cap * tanh(logits / cap)``, Gemma 2), or None.
        logit_scale: the logits are multiplied by it right after the head, before the softcap (Cohere's
            ``logit_scale``, Granite's ``1 / logits_scaling``); 1.0 for none.

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
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    # the gradient is formed in the forward when a backward will want it (training; not evaluation)
    form_grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    loss_sum = _ChunkedLMHeadLoss.apply(
        hidden, weight, bias, index, flat.index_select(0, index), int(chunk_size),
        None if softcap is None else float(softcap), float(logit_scale), form_grads,
    )
    return loss_sum, num_valid
