"""Gradients of a residual SSM language model by adjoint sharding (paper 002, Secs. 4.1-4.4).

Holds:
    adjoint_layer_backward: one layer's parameter gradients and input gradient from the gradient of
        its output, as chunked vector-Jacobian products around an adjoint scan.
    AdjointPlan: how one process computes gradients (chunk size, truncation, which layers it owns,
        its neighbours in the layer pipeline); its ``loss`` is the training forward.

Shape legend: B batch, T sequence, C chunk, P hidden, D inner channels, N state size, V vocab.

The math, for one layer with input x (B, T, P), per-token maps (a_t, b_t, ctx_t) = pre(x_t) and
out_t = post(h_t, ctx_t) around h_t = a_t * h_{t-1} + b_t, and g_t = dL/dout_t:
    c_t  = (d post / d h_t)^T g_t                            per token (a VJP of post)
    mu_t = sum_{t' >= t} lambda^{t', t},  lambda^{t', t} = c_{t'} prod_{j=t+1}^{t'} a_j
         = c_t + a_{t+1} * mu_{t+1}                          the adjoint state, one backward scan
    dL/dtheta = sum_t VJP_theta[ g_t . post_t + (mu_t * h_{t-1}) . a_t + mu_t . b_t ]
Paper 002's propositions 2-3 write the gradient as sum_t sum_{i <= t} VJP(lambda^{t,i} ...), T(T+1)/2
VJPs; a VJP is linear in its vector, so summing the lambdas first (the scan above) gives the same
gradient with T VJPs, which are independent per token and batched here C tokens at a time.
Truncated adjoint sharding (Sec. 4.3) keeps lambda^{t', t} only for t' - t < T-bar.

The same VJP also gives dL/dx_t, which the layer below needs: the gradient reaching layer k is
dL/dy_k (the residual stream after layer k), not dL/dy_K as propositions 3's derivation assumes
(it treats each layer's input as a constant; the layers above depend on it). The exact gradient
therefore passes dL/dy_k down the stack, one (B, T, P) tensor per layer, and across ranks in the
distributed version (the reverse of the forward pipeline of Alg. 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_longseq.adjoint import pipeline as comm
from ds_longseq.families.ssm import SSMStack, ssm_stack
from ds_longseq.ops.chunk_grads import acc_dtype
from ds_longseq.ops.linear_scan import adjoint_scan, linear_scan, truncated_adjoint
from ds_longseq.ops.lm_head_loss import chunked_lm_head_loss, shift_causal_labels

__all__ = ["adjoint_layer_backward", "layer_forward", "AdjointPlan", "make_plan"]


def _bounds(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


def layer_forward(layer, x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``residual(x) + post(scan(pre(x)))`` chunk by chunk, the state carried across chunks.

    Run under no_grad: holds one chunk's (B, C, D, N) decays, inputs and states at a time, not the
    whole sequence's.

    Args:
        layer: a layer's maps (``halo``, ``pre``, ``post``, ``residual``; see ``stacks``).
        x: (B, T, P) the layer's input.
        chunk_size: C.

    Returns:
        (B, T, P) the layer's output.
    """
    outs = [layer.post(h, ctx) for _, h, ctx in _chunk_scans(layer, x, chunk_size)]
    return layer.residual(x) + torch.cat(outs, dim=1)


def _chunk_scans(layer, x: torch.Tensor, chunk_size: int):
    """Per chunk, first to last: (the state before it, its states h (B, C, D, N), its ``pre`` context),
    the state carried from chunk to chunk. Call under no_grad."""
    carry = None
    for s, e in _bounds(x.shape[1], chunk_size):
        lo = max(0, s - layer.halo)
        a, b, ctx = layer.pre(x[:, lo:e], s - lo)
        h = linear_scan(a, b, carry)
        yield carry, h, ctx
        carry = h[:, -1].clone()  # a view would keep the whole chunk alive


def adjoint_layer_backward(
    layer,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    params: list[torch.nn.Parameter],
    *,
    chunk_size: int,
    truncation: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Gradients of one residual SSM layer ``y = residual(x) + post(scan(pre(x)))`` by the adjoint method.

    Exact (``truncation`` None or >= T): streamed over chunks, last chunk first. A forward sweep keeps
    only the state at each chunk boundary ((T / C) x (B, D, N)); each chunk then recomputes its
    states from its boundary state, its adjoint from the carry a_e * mu_e of the chunk after it, and
    its VJPs, so memory holds one chunk's (B, C, D, N) tensors and graph at a time.

    Truncated: the adjoint needs c_t up to T-bar tokens ahead, so a, h and mu are held for the whole
    sequence ((B, T, D, N) each) and the VJPs then run chunk by chunk.

    Args:
        layer: a layer's maps: ``pre(x, num_halo)``, ``post(h, ctx)``, ``halo`` (see ``stacks``;
            ``ds_longseq.families.residual_ssm.SelectiveSSMLayer`` has them).
        x: (B, T, P) the layer's input, as in forward.
        grad_out: (B, T, P) dL/dy, the gradient of the layer's output (residual stream).
        params: the layer's parameters to differentiate.
        chunk_size: tokens per batched VJP.
        truncation: T-bar, keep only lambda^{t', t} with t' - t < T-bar; None: exact.

    Returns:
        (dL/dx (B, T, P) in float32 for half precision, else x's dtype; gradients of ``params`` in the
        same accumulation dtype, None for a parameter the layer does not use).
    """
    dtype = acc_dtype(x.dtype)
    grad_x = torch.zeros(x.shape, dtype=dtype, device=x.device)
    grads: list[torch.Tensor | None] = [None] * len(params)

    def vjp(s, e, x_w, out, a_c, b_c, mu_c, h_prev):
        """Accumulate VJP[g . out + (mu * h_prev) . a + mu . b] over the chunk's input and params."""
        results = torch.autograd.grad(
            [out, a_c, b_c], [x_w, *params], [grad_out[:, s:e].to(out.dtype), mu_c * h_prev, mu_c],
            allow_unused=True,
        )
        grad_x[:, max(0, s - layer.halo) : e] += results[0]
        for i, g in enumerate(results[1:]):
            if g is not None:
                grads[i] = g.to(dtype) if grads[i] is None else grads[i].add_(g)

    if truncation is None or truncation >= x.shape[1]:
        _streamed(layer, x, grad_out, chunk_size, vjp)
    else:
        _truncated(layer, x, grad_out, chunk_size, truncation, vjp)
    grad_x += grad_out  # the residual path
    return grad_x, grads


def _streamed(layer, x, grad_out, chunk_size, vjp) -> None:
    bounds = _bounds(x.shape[1], chunk_size)
    with torch.no_grad():
        starts = [start for start, _, _ in _chunk_scans(layer, x, chunk_size)]  # the state before each chunk
    carry = None  # a_e * mu_e of the chunk after this one
    for (s, e), start in zip(reversed(bounds), reversed(starts), strict=True):
        lo = max(0, s - layer.halo)
        with torch.enable_grad():
            x_w = x[:, lo:e].detach().requires_grad_()
            a_c, b_c, ctx_c = layer.pre(x_w, s - lo)
            with torch.no_grad():
                h = linear_scan(a_c, b_c, start)
            h_leaf = h.requires_grad_()
            out = layer.post(h_leaf, ctx_c)
            # c_t: what out_t asks of h_t; the graph stays for the VJP below
            (c,) = torch.autograd.grad(out, h_leaf, grad_out[:, s:e].to(out.dtype), retain_graph=True)
        with torch.no_grad():
            mu = adjoint_scan(a_c, c, carry)
            del c
            carry = a_c[:, 0] * mu[:, 0]
            first = torch.zeros_like(h[:, :1]) if start is None else start.unsqueeze(1)
            h_prev = torch.cat([first, h[:, :-1]], dim=1)
        with torch.enable_grad():
            vjp(s, e, x_w, out, a_c, b_c, mu, h_prev)


def _truncated(layer, x, grad_out, chunk_size, truncation, vjp) -> None:
    bounds = _bounds(x.shape[1], chunk_size)
    with torch.no_grad():
        a_parts, b_parts, ctx_parts = [], [], []
        for s, e in bounds:
            lo = max(0, s - layer.halo)
            a_c, b_c, ctx_c = layer.pre(x[:, lo:e], s - lo)
            a_parts.append(a_c)
            b_parts.append(b_c)
            ctx_parts.append(ctx_c)
        a = torch.cat(a_parts, dim=1)
        del a_parts
        h = linear_scan(a, torch.cat(b_parts, dim=1))
        del b_parts
    # c_t: what out_t asks of h_t, one VJP of post per chunk (its context is fixed, h varies)
    c = torch.empty_like(h)
    for (s, e), ctx_c in zip(bounds, ctx_parts, strict=True):
        with torch.enable_grad():
            h_c = h[:, s:e].detach().requires_grad_()
            out = layer.post(h_c, ctx_c)
            (c[:, s:e],) = torch.autograd.grad(out, h_c, grad_out[:, s:e].to(out.dtype))
    del ctx_parts
    with torch.no_grad():
        mu = truncated_adjoint(a, c, truncation)
    del c, a
    for s, e in bounds:
        lo = max(0, s - layer.halo)
        h_prev = h[:, s - 1 : e - 1] if s > 0 else torch.cat([torch.zeros_like(h[:, :1]), h[:, : e - 1]], dim=1)
        with torch.enable_grad():
            x_w = x[:, lo:e].detach().requires_grad_()
            a_c, b_c, ctx_c = layer.pre(x_w, s - lo)
            out = layer.post(h[:, s:e], ctx_c)  # h is a constant here: its share is in mu
            vjp(s, e, x_w, out, a_c, b_c, mu[:, s:e], h_prev)


@dataclass
class AdjointPlan:
    """How this process trains a :class:`ResidualSSMForCausalLM` by adjoint sharding.

    Single process: ``stage_layers == [(0, K)]``. Distributed (paper 002 Alg. 4): stage ``stage`` of
    ``len(stage_layers)`` owns layers ``stage_layers[stage]``; the first stage also embeds, the last
    also runs the final norm, LM head and loss. Forward passes the residual stream up the stages,
    backward passes dL/dy down; every stage computes its own layers' gradients.
    """

    chunk_size: int
    """Tokens per batched vector-Jacobian product (and per chunk of LM-head logits)."""
    truncation: int | None = None
    """T-bar of truncated adjoint sharding; None: exact gradients."""
    stage_layers: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of the layers of each stage, in order."""
    stage: int = 0
    """This process's stage."""
    stage_ranks: list[int] | None = None
    """Global rank of each stage's process (None: single process)."""
    grad_scale: float = 1.0
    """Multiplies every gradient: the number of stages under DeepSpeed, whose data-parallel average
    over them divides by it while each parameter's gradient comes from a single stage."""

    @property
    def layers(self) -> range:
        """The layers this process owns."""
        return range(*self.stage_layers[self.stage])

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.stage_layers) - 1

    def loss(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over valid tokens; its backward computes every gradient by adjoint sharding.

        Args:
            model: a :class:`ResidualSSMForCausalLM` or transformers' ``MambaForCausalLM`` (see ``stacks``).
            input_ids: (B, T) token ids (the same on every stage).
            labels: (B, T) labels, shifted inside (position t predicts labels[t + 1]); -100 ignored.
        """
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        targets = shift_causal_labels(labels)
        if self.stage_ranks is not None:
            comm.check_same_batch(input_ids, targets)
        params = [p for p in model.parameters() if p.requires_grad]
        loss_sum = _AdjointCausalLM.apply(self, ssm_stack(model), input_ids, targets, *params)
        return loss_sum / (targets != -100).sum()


def make_plan(
    num_layers: int,
    *,
    chunk_size: int,
    truncation: int | None,
    layer_split: list[int] | None,
    world_size: int,
    rank: int,
    grad_scale: float,
) -> AdjointPlan:
    """The plan of process ``rank`` of ``world_size`` (a single process: world_size=1, rank=0)."""
    stages = comm.split_layers(num_layers, world_size, layer_split)
    return AdjointPlan(
        chunk_size=chunk_size,
        truncation=truncation,
        stage_layers=stages,
        stage=rank,
        stage_ranks=list(range(world_size)) if world_size > 1 else None,
        grad_scale=grad_scale,
    )


def _head_loss_sum(stack: SSMStack, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    head = stack.lm_head
    hidden = stack.norm_f(hidden).to(head.weight.dtype)
    loss_sum, _ = chunked_lm_head_loss(hidden, head.weight, targets, chunk_size=chunk_size, bias=head.bias)
    return loss_sum


class _AdjointCausalLM(torch.autograd.Function):
    """Forward without a graph; backward = head VJP, adjoint layer backward, embedding VJP.

    Takes every trainable parameter as an input and returns a gradient for each (zeros for those
    another stage owns) in one call: each parameter's gradient accumulates once per micro-step, and
    the autograd graph, so the order in which DeepSpeed's reduction hooks fire, is the same on every stage.
    """

    @staticmethod
    def forward(ctx, plan: AdjointPlan, stack: SSMStack, input_ids, targets, *params):
        with torch.no_grad():
            if plan.is_first:
                y = stack.embed(input_ids)
            else:
                shape = (*input_ids.shape, stack.hidden_size)
                y = comm.recv_from(plan, plan.stage - 1, shape, stack.stream_dtype, input_ids.device)
            inputs = []
            for k in plan.layers:
                inputs.append(y)
                y = layer_forward(stack.layers[k], y, plan.chunk_size)
            if plan.is_last:
                loss_sum = _head_loss_sum(stack, y, targets, plan.chunk_size)
            else:
                comm.send_to(plan, plan.stage + 1, y)
                loss_sum = torch.zeros((), dtype=acc_dtype(stack.lm_head.weight.dtype), device=y.device)
            if plan.stage_ranks is not None:
                comm.broadcast_from_last(plan, loss_sum)
        ctx.plan, ctx.stack, ctx.params = plan, stack, params
        ctx.inputs, ctx.output = inputs, y if plan.is_last else None
        ctx.save_for_backward(input_ids, targets)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        plan, stack, params = ctx.plan, ctx.stack, ctx.params
        input_ids, targets = ctx.saved_tensors
        grads: dict[int, torch.Tensor] = {}

        def add(param, g):
            if g is not None:
                key = id(param)
                grads[key] = g.to(acc_dtype(param.dtype)) if key not in grads else grads[key].add_(g)

        if plan.is_last:
            head_params = [p for p in (*stack.norm_f.parameters(), *stack.lm_head.parameters()) if p.requires_grad]
            with torch.enable_grad():
                y = ctx.output.detach().requires_grad_()
                loss_sum = _head_loss_sum(stack, y, targets, plan.chunk_size)
                grad_y, *head_grads = torch.autograd.grad(loss_sum, [y, *head_params], grad_loss, allow_unused=True)
            for p, g in zip(head_params, head_grads, strict=True):
                add(p, g)
            grad_y = grad_y.to(acc_dtype(grad_y.dtype))
            ctx.output = None
        else:
            x = ctx.inputs[-1] if ctx.inputs else None
            grad_y = comm.recv_from(plan, plan.stage + 1, tuple(x.shape), acc_dtype(x.dtype), x.device)
        for k, x in zip(reversed(plan.layers), reversed(ctx.inputs), strict=True):
            layer = stack.layers[k]
            layer_params = [p for p in layer.parameters() if p.requires_grad]
            grad_y, layer_grads = adjoint_layer_backward(
                layer, x, grad_y, layer_params, chunk_size=plan.chunk_size, truncation=plan.truncation
            )
            for p, g in zip(layer_params, layer_grads, strict=True):
                add(p, g)
        ctx.inputs = None
        if plan.is_first:
            weight = stack.embed.weight
            if weight.requires_grad:
                g = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device)
                g.index_add_(0, input_ids.reshape(-1), grad_y.reshape(-1, grad_y.shape[-1]).to(g.dtype))
                add(weight, g)
        else:
            comm.send_to(plan, plan.stage - 1, grad_y.contiguous())
        out = []
        for p in params:
            g = grads.get(id(p))
            g = torch.zeros_like(p) if g is None else g.to(p.dtype)
            out.append(g.mul_(plan.grad_scale) if plan.grad_scale != 1.0 else g)
        return (None, None, None, None, *out)
