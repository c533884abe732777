"""The residual selective diagonal state-space language model of paper 002 (adjoint sharding).

Holds:
    SSMConfig: sizes of the model (typed, validated).
    RMSNorm: per-token RMS norm, computed in float32 for half-precision inputs.
    SelectiveSSMLayer: one SSM layer, split into the per-token maps the adjoint method needs
        (``pre``: input -> decay a_t, input b_t = B_t x_t and the output context; ``post``: state
        h_t -> output) around the linear recurrence h_t = a_t * h_{t-1} + b_t.
    ResidualSSMForCausalLM: embedding, K residual SSM layers y_k = y_{k-1} + SSM_k(Norm(y_{k-1})),
        final norm, LM head. Plain autograd by default (the reference); ``ds_longseq.enable`` with
        ``long_seq.adjoint`` switches its training forward to adjoint sharding.

Shape legend: B batch, T sequence, C chunk of tokens, P hidden size, D inner channels,
N state size per channel, V vocab.

The layer (paper 002 Sec. 3.1, with Mamba's per-channel parameterisation of a diagonal SSM):
    x_t = Norm(y_t)                                   (P)
    u_t = W_u x_t, or silu(causal_conv(W_u x)_t)      (D)   conv_kernel > 1: a local window
    delta_t = softplus(W_dt x_t + b_dt)                (D)
    B_t, C_t = W_B x_t, W_C x_t                        (N), (N)
    a_t = exp(-delta_t (x) exp(A_log))                 (D, N)  the diagonal of A_t, in (0, 1)
    b_t = (delta_t * u_t) (x) B_t                      (D, N)  = B_t x_t of the paper
    h_t = a_t * h_{t-1} + b_t                          (D, N)
    out_t = W_out (h_t C_t + D_skip * u_t)             (P)     y_t = C_t h_t
The recurrence is linear in h and every other map is per token (or, with a convolution, per
window of ``conv_kernel`` tokens): the assumptions of propositions 1-3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_longseq.ops.chunk_grads import acc_dtype
from ds_longseq.ops.linear_scan import LinearScan
from ds_longseq.ops.lm_head_loss import shift_causal_labels

__all__ = ["SSMConfig", "RMSNorm", "SelectiveSSMLayer", "ResidualSSMForCausalLM", "SSMOutput"]


@dataclass
class SSMConfig:
    """Sizes of :class:`ResidualSSMForCausalLM`."""

    vocab_size: int = 256
    """V: number of token ids."""
    hidden_size: int = 64
    """P: width of the residual stream."""
    inner_size: int | None = None
    """D: channels of each SSM (each with its own N-dim state); None: 2 x hidden_size."""
    state_size: int = 16
    """N: state dimension per channel."""
    num_layers: int = 4
    """K: residual SSM layers."""
    conv_kernel: int = 1
    """Width of the causal depthwise convolution on u (Mamba uses 4); 1: none, A_t, B_t, C_t and u_t
    depend on token t only, as in the paper."""
    norm_eps: float = 1e-6
    """Epsilon of the RMS norms."""
    tie_word_embeddings: bool = False
    """Share the embedding matrix with the LM head."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of embeddings and projections."""
    model_type: str = "ds_longseq_ssm"
    """Fixed: tells this model apart from Hugging Face families in errors and logs."""

    def __post_init__(self):
        if self.inner_size is None:
            self.inner_size = 2 * self.hidden_size
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"SSMConfig.{f.name} must be a positive integer, got {value!r}")
        if not self.norm_eps > 0:
            problems.append(f"SSMConfig.norm_eps must be positive, got {self.norm_eps!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim; float32 math for half-precision inputs (as transformers)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(acc_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SelectiveSSMLayer(nn.Module):
    """One residual SSM layer; ``forward(y) = y + post(scan(pre(y)))``.

    ``pre`` and ``post`` are the per-token maps around the recurrence; the adjoint backward
    (``ds_longseq.adjoint.sharding``) re-runs them chunk by chunk for its vector-Jacobian products.
    The scan quantities (a, b, h) are kept in float32 for half-precision models.
    """

    def __init__(self, config: SSMConfig):
        super().__init__()
        p, d, n = config.hidden_size, config.inner_size, config.state_size
        self.state_size = n
        self.halo = config.conv_kernel - 1
        """Tokens before a chunk that its per-token maps read (the convolution's reach)."""
        self.norm = RMSNorm(p, config.norm_eps)
        self.in_proj = nn.Linear(p, d, bias=False)
        self.conv = nn.Conv1d(d, d, config.conv_kernel, groups=d) if config.conv_kernel > 1 else None
        self.dt_proj = nn.Linear(p, d, bias=True)
        self.bc_proj = nn.Linear(p, 2 * n, bias=False)
        # Mamba's S4D-real init: channel decay rates 1..N; the first step is dt ~ softplus(bias)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1))
        self.D_skip = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, p, bias=False)

    def pre(self, x: torch.Tensor, num_halo: int = 0):
        """Per-token maps before the recurrence.

        Args:
            x: (B, num_halo + C, P) layer inputs (the residual stream, before the norm); the first
                ``num_halo`` tokens are context read by the convolution only.
            num_halo: how many of x's tokens precede the chunk (<= self.halo; fewer at the start of
                the sequence, where the convolution sees zeros).

        Returns:
            a: (B, C, D, N) decays, b: (B, C, D, N) inputs B_t x_t, ctx: (u (B, C, D), C_t (B, C, N)).
        """
        xn = self.norm(x)
        u = self.in_proj(xn)
        if self.conv is not None:
            u = F.pad(u.transpose(1, 2), (self.halo - num_halo, 0))
            u = F.silu(self.conv(u)).transpose(1, 2)
        xn = xn[:, num_halo:]
        scan_dtype = acc_dtype(x.dtype)
        delta = F.softplus(self.dt_proj(xn)).to(scan_dtype)
        b_vec, c_vec = self.bc_proj(xn).to(scan_dtype).split(self.state_size, dim=-1)
        a = torch.exp(delta.unsqueeze(-1) * -torch.exp(self.A_log.to(scan_dtype)))
        b = (delta * u.to(scan_dtype)).unsqueeze(-1) * b_vec.unsqueeze(-2)
        return a, b, (u, c_vec)

    def post(self, h: torch.Tensor, ctx) -> torch.Tensor:
        """Per-token map after the recurrence: (B, C, D, N) states -> (B, C, P) layer outputs."""
        u, c_vec = ctx
        y = (h * c_vec.unsqueeze(-2)).sum(-1).to(u.dtype) + self.D_skip * u
        return self.out_proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, ctx = self.pre(x)
        return x + self.post(LinearScan.apply(a, b), ctx)


@dataclass
class SSMOutput:
    """What :class:`ResidualSSMForCausalLM` returns (attribute access like transformers' outputs)."""

    loss: torch.Tensor | None = None
    """Mean cross entropy over valid (label != -100) tokens, when labels are given."""
    logits: torch.Tensor | None = None
    """(B, T, V); None on the adjoint training path, which never materialises them."""

    def __getitem__(self, key: str):
        return getattr(self, key)


class ResidualSSMForCausalLM(nn.Module):
    """Embedding -> K x :class:`SelectiveSSMLayer` (residual) -> RMSNorm -> LM head."""

    adjoint_plan = None
    """Set per instance by ``ds_longseq.enable`` with ``long_seq.adjoint`` (an ``AdjointPlan``): the
    training forward then computes gradients by adjoint sharding. None: plain autograd."""

    def __init__(self, config: SSMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SelectiveSSMLayer(config) for _ in range(config.num_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
        for layer in self.layers:
            # dt in [1e-3, 1e-1] log-uniformly (Mamba): softplus(bias) = dt
            dt = torch.exp(torch.rand_like(layer.dt_proj.bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            layer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            # residual branches start small so the stack starts near the identity (GPT-2's scaling)
            layer.out_proj.weight.mul_(1.0 / math.sqrt(2 * len(self.layers)))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> SSMOutput:
        """Args:
            input_ids: (B, T) token ids.
            labels: (B, T) targets; position t is trained to predict labels[t + 1] (transformers'
                shift); -100 is ignored.
            attention_mask: (B, T) optional; only right padding is allowed (an SSM has no mask: pad
                tokens after the text cannot reach it, pad tokens before it would).
        """
        if kwargs:
            raise TypeError(f"ResidualSSMForCausalLM.forward got unexpected arguments {sorted(kwargs)}")
        check_right_padded(attention_mask)
        plan = self.adjoint_plan
        if plan is not None and labels is not None and torch.is_grad_enabled():
            return SSMOutput(loss=plan.loss(self, input_ids, labels))
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.lm_head(self.norm_f(hidden))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        return SSMOutput(loss=loss, logits=logits)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of (B, T, V) logits against shifted (B, T) labels, in float32 for half
    precision and float64 for float64 logits (no rounding to float32 as transformers' loss does)."""
    targets = shift_causal_labels(labels)
    logits = logits.to(acc_dtype(logits.dtype))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="mean")


def check_right_padded(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is None:
        return
    mask = attention_mask.bool()
    # right padding: once a row reaches a 0 it stays 0 (cummin of the mask equals the mask)
    if not torch.equal(mask.int().cummin(dim=-1).values.bool(), mask):
        raise ValueError(
            "attention_mask has padding before or inside the text: an SSM reads every token into its "
            "state, so only right padding (pad tokens after the text, labels -100) is exact; pad on the right"
        )
