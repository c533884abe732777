"""What adjoint sharding needs from a model: its residual SSM stack, as per-token maps (one adapter per family).

Holds:
    SSMStack: embedding, the layers' maps, final norm, LM head, and the residual stream's dtype.
    MambaLayerMaps: ``pre`` / ``post`` / ``residual`` of a Hugging Face ``MambaBlock`` (Mamba-1),
        the same arithmetic as transformers' torch path (``MambaMixer`` + ``mamba_selective_scan``).
    Mamba2LayerMaps: the same for a ``Mamba2Block`` (``Mamba2Mixer`` + ``mamba2_chunk_scan``).
    ssm_stack: the stack of a ``ResidualSSMForCausalLM`` or a ``MambaForCausalLM``; any other model
        is refused with the reason (``UNSUPPORTED_SSM_FAMILIES`` names the term that breaks the method).

A layer's maps (shape legend: B batch, C chunk, P hidden, D channels, N state):
    halo: tokens before a chunk that ``pre`` reads (a causal convolution of width halo + 1);
    pre(x, num_halo) -> a (B, C, D, N), b (B, C, D, N), ctx: the recurrence's decay and input;
    post(h, ctx) -> (B, C, P): the layer's output from its states;
    residual(x) -> x as the residual stream carries it (Mamba: float32 with ``residual_in_fp32``).
The layer computes ``residual(x) + post(scan(pre(x)))``.

Why Hugging Face's Mamba-1 and Mamba-2 fit propositions 1-3: Mamba-1's recurrence h_t = exp(dt_t A)
h_{t-1} + dt_t B_t u_t is linear in h with a diagonal decay; everything else is per token (in_proj,
x_proj, dt_proj, the D skip, the silu(z) gate, out_proj) or a causal convolution of width conv_kernel
(the halo). Mamba-2 is the same with one decay per head and the convolution over x, B and C together;
its gated RMSNorm is per token (over groups of channels). Their padding mask is applied to the
convolution's input and output; with right padding only (which the adjoint path requires) it does not
reach any trained token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_longseq.families.decoder import UnsupportedModelError
from ds_longseq.families.residual_ssm import ResidualSSMForCausalLM
from ds_longseq.ops.chunk_grads import acc_dtype

__all__ = ["SSMStack", "MambaLayerMaps", "Mamba2LayerMaps", "ssm_stack", "UNSUPPORTED_SSM_FAMILIES"]

UNSUPPORTED_SSM_FAMILIES = {
    "falcon_mamba": "Falcon-Mamba adds RMS norms on B, C and dt inside the mixer; its maps are not written yet",
    "jamba": "Jamba interleaves attention layers, whose output at t depends on every earlier token, not on a state",
    "bamba": "Bamba interleaves attention layers, whose output at t depends on every earlier token, not on a state",
    "zamba": "Zamba interleaves shared attention blocks, whose output depends on every earlier token",
    "zamba2": "Zamba2 interleaves shared attention blocks, whose output depends on every earlier token",
    "rwkv": "RWKV's time mixing normalises by a running sum (WKV), a recurrence that is not linear in its state",
}
"""Families refused by ``long_seq.adjoint``, with the term that breaks (or is missing for) the method."""


@dataclass
class SSMStack:
    """The pieces of a residual SSM language model that adjoint sharding drives."""

    embed: nn.Embedding
    layers: list
    """Each layer's maps (``halo``, ``pre``, ``post``, ``residual``, ``parameters()``)."""
    norm_f: nn.Module
    lm_head: nn.Linear
    hidden_size: int
    stream_dtype: torch.dtype
    """dtype of the residual stream after the first layer (the inputs of layers 1..K-1)."""


class MambaLayerMaps:
    """The maps of one Hugging Face ``MambaBlock``: norm -> mixer (in_proj, conv, x_proj, dt, scan, gate,
    out_proj), plus the residual."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.mixer = block.mixer
        self.halo = self.mixer.conv_kernel_size - 1

    def parameters(self):
        return self.block.parameters()

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) if self.block.residual_in_fp32 else x

    def pre(self, x: torch.Tensor, num_halo: int = 0):
        m = self.mixer
        xn = self.block.norm(x.to(self.block.norm.weight.dtype))
        u, z = m.in_proj(xn).chunk(2, dim=-1)
        u = F.pad(u.transpose(1, 2), (self.halo - num_halo, 0))
        u = F.conv1d(u.to(m.conv1d.weight.dtype), m.conv1d.weight, m.conv1d.bias, groups=m.intermediate_size)
        u = m.act(u).to(xn.dtype).transpose(1, 2)  # (B, C, D)
        dt, b_vec, c_vec = torch.split(m.x_proj(u), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        # transformers upcasts with .float(); acc_dtype does the same for half and float32 models and keeps
        # float64 models in float64 (where .float() would round A_log, dt's bias, B and u to float32)
        acc = acc_dtype(m.A_log.dtype)
        dt = F.softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias.to(acc))
        a = torch.exp(-torch.exp(m.A_log.to(acc)) * dt.unsqueeze(-1))
        b = dt.unsqueeze(-1) * b_vec.unsqueeze(-2).to(acc) * u.unsqueeze(-1).to(acc)
        return a, b, (u, z[:, num_halo:], c_vec, xn.dtype)

    def post(self, h: torch.Tensor, ctx) -> torch.Tensor:
        u, z, c_vec, dtype = ctx
        y = (h.to(u.dtype) * c_vec.unsqueeze(-2)).sum(-1)
        y = (y + u * self.mixer.D.to(acc_dtype(self.mixer.D.dtype))) * F.silu(z)
        return self.mixer.out_proj(y.to(dtype))


class Mamba2LayerMaps(MambaLayerMaps):
    """The maps of one Hugging Face ``Mamba2Block``: norm -> in_proj (gate, x|B|C, dt), causal conv over
    x|B|C, a scalar decay exp(dt_h A_h) per head (broadcast over its head_dim x N states), gated RMSNorm,
    out_proj. The same arithmetic as transformers' torch path (``mamba2_chunk_scan``), whose SSD chunking
    is only a way to evaluate the same recurrence."""

    def pre(self, x: torch.Tensor, num_halo: int = 0):
        m = self.mixer
        xn = self.block.norm(x.to(self.block.norm.weight.dtype))
        gate, xbc, dt = m.in_proj(xn).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        xbc = F.pad(xbc.transpose(1, 2), (self.halo - num_halo, 0))
        xbc = F.conv1d(xbc.to(m.conv1d.weight.dtype), m.conv1d.weight, m.conv1d.bias, groups=m.conv_dim)
        xbc = m.act(xbc).to(xn.dtype).transpose(1, 2)  # (B, C, conv_dim)
        group_state = m.n_groups * m.ssm_state_size
        xs, b_vec, c_vec = torch.split(xbc, [m.intermediate_size, group_state, group_state], dim=-1)
        acc = acc_dtype(m.A_log.dtype)
        dt = F.softplus(dt[:, num_halo:] + m.dt_bias.to(dt.dtype))
        dt = torch.clamp(dt, min=m.time_step_limit[0], max=m.time_step_limit[1]).to(acc)  # (B, C, H)
        batch, length = xs.shape[:2]
        heads_per_group = m.num_heads // m.n_groups
        xs = xs.reshape(batch, length, m.num_heads, m.head_dim).to(acc)
        b_vec = b_vec.reshape(batch, length, m.n_groups, m.ssm_state_size).to(acc)
        b_vec = b_vec.repeat_interleave(heads_per_group, dim=2)
        c_vec = c_vec.reshape(batch, length, m.n_groups, m.ssm_state_size).to(acc)
        c_vec = c_vec.repeat_interleave(heads_per_group, dim=2)
        decay = torch.exp(dt * -torch.exp(m.A_log.to(acc)))  # (B, C, H)
        b = (xs * dt.unsqueeze(-1)).unsqueeze(-1) * b_vec.unsqueeze(-2)  # (B, C, H, head_dim, N)
        a = decay[..., None, None].expand(b.shape)
        return a, b, (xs, c_vec, gate[:, num_halo:], xn.dtype)

    def post(self, h: torch.Tensor, ctx) -> torch.Tensor:
        xs, c_vec, gate, dtype = ctx
        m = self.mixer
        y = (h * c_vec.unsqueeze(-2)).sum(-1) + m.D.to(xs.dtype)[:, None] * xs  # (B, C, H, head_dim)
        y = m.norm(y.reshape(*y.shape[:2], -1), gate)
        return m.out_proj(y.to(dtype))


class _NativeMaps:
    """``SelectiveSSMLayer`` already has ``pre`` / ``post`` / ``halo``; its residual is the identity."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.halo = layer.halo
        self.pre, self.post = layer.pre, layer.post

    def parameters(self):
        return self.layer.parameters()

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x


def ssm_stack(model: nn.Module) -> SSMStack:
    """The :class:`SSMStack` of ``model``.

    Raises:
        UnsupportedModelError: ``model`` is not a residual SSM stack this package has maps for; the
            message says which term breaks the method (or what is missing).
    """
    if isinstance(model, ResidualSSMForCausalLM):
        dtype = model.embed.weight.dtype
        return SSMStack(model.embed, [_NativeMaps(layer) for layer in model.layers], model.norm_f, model.lm_head,
                        model.config.hidden_size, dtype)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    maps = {("MambaForCausalLM", "mamba"): MambaLayerMaps, ("Mamba2ForCausalLM", "mamba2"): Mamba2LayerMaps}
    family = maps.get((type(model).__name__, model_type))
    if family is not None:
        backbone = model.backbone
        dtype = backbone.embeddings.weight.dtype
        stream = torch.float32 if config.residual_in_fp32 else dtype
        return SSMStack(backbone.embeddings, [family(block) for block in backbone.layers], backbone.norm_f,
                        model.lm_head, config.hidden_size, torch.promote_types(stream, dtype))
    why = UNSUPPORTED_SSM_FAMILIES.get(
        model_type,
        "adjoint sharding needs a recurrence that is linear in its state with per-token maps around it, "
        "which attention layers are not",
    )
    raise UnsupportedModelError(
        f"long_seq.adjoint needs a residual state-space model stack (ds_longseq.adjoint.ResidualSSMForCausalLM, "
        f"transformers' MambaForCausalLM or Mamba2ForCausalLM), got {type(model).__name__} "
        f"(model_type={model_type!r}): {why}. "
        "Disable long_seq.adjoint for this model"
    )
