"""Approx-BP replacement forwards and the norm-weight fold, built on ``ds_longseq.ops.approx_autograd``.

Holds:
    ApproxActivationForward: installed as an activation module's ``forward`` (ReSiLU2 / ReGELU2).
    MSNormForward: installed as a norm module's ``forward`` (MS-RMSNorm / MS-LN) once its affine
        parameters are folded away.
    FoldTarget, fold_targets: the parameters a norm's weight folds into, for a consuming module
        (``nn.Linear``, a PEFT LoRA layer around one, a router or expert weight tensor).
    fold_norm: the fold itself (Approx-BP paper Eqn. (17)): ``W~ = W diag(alpha)``, ``b~ = W beta + b``.

Activation classes by kind (``ACTIVATION_KINDS``) are family data (``ds_longseq.families``), not scattered checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_longseq.compat import is_zero3_partitioned, tensor_version
from ds_longseq.families.decoder import ACTIVATION_KINDS  # re-exported: it was defined here
from ds_longseq.ops.approx_autograd import StepDerivative, approx_activation, ms_layer_norm, ms_rms_norm

__all__ = [
    "ACTIVATION_KINDS",
    "ApproxActivationForward",
    "MSNormForward",
    "FoldTarget",
    "FoldError",
    "fold_targets",
    "fold_norm",
]

class FoldError(ValueError):
    """A norm's affine parameters cannot be folded into the layers after it without changing the model."""


class ApproxActivationForward:
    """Replacement ``forward`` of one activation module: the stock output, a step derivative in backward."""

    def __init__(self, module: torch.nn.Module, orig_forward: Callable, step: StepDerivative):
        self.module = module
        self.orig_forward = orig_forward
        self.step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return approx_activation(x, self.orig_forward, self.step)


class MSNormForward:
    """Replacement ``forward`` of a norm whose weight (and bias) were folded into its consumers.

    (B, T, d) -> (B, T, d), normalised without affine. The folded weight is fixed at 1 (bias 0) and
    frozen; the forward does not read it, so a weight changed afterwards (loading an unfolded
    checkpoint into the enabled model, say) would be ignored silently: it is checked whenever its
    version counter moves (not under ZeRO-3, whose gathers replace the data every step).
    """

    def __init__(self, norm: torch.nn.Module, kind: str, eps: float, where: str):
        if kind not in ("rms", "layer"):
            raise ValueError(f"MSNormForward: kind must be 'rms' or 'layer', got {kind!r}")
        self.norm = norm
        self.kind = kind
        self.eps = eps
        self.where = where
        self._versions = self._current_versions()

    def _affine(self) -> list[tuple[str, torch.Tensor, float]]:
        out = [("weight", self.norm.weight, 1.0)]
        if getattr(self.norm, "bias", None) is not None:
            out.append(("bias", self.norm.bias, 0.0))
        return out

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(tensor_version(t) for _, t, _ in self._affine())

    def _check_unchanged(self) -> None:
        if any(is_zero3_partitioned(t) for _, t, _ in self._affine()):
            return
        versions = self._current_versions()
        if versions == self._versions:
            return
        for name, t, value in self._affine():
            if t.numel() and not bool((t == value).all()):
                raise RuntimeError(
                    f"{self.where}.{name} changed after ds_longseq folded it into the next layers (long_seq.approx_bp."
                    f"norm): it must stay {value} (an unfolded checkpoint loaded into the enabled model?). Load "
                    "checkpoints before ds_longseq.enable, or load the folded ones this model saves"
                )
        self._versions = versions

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._check_unchanged()
        if self.kind == "rms":
            return ms_rms_norm(x, self.eps)
        return ms_layer_norm(x, self.eps)


@dataclass
class FoldTarget:
    """One weight tensor (and the bias beside it) that a norm's output feeds, in-features on its last dim."""

    where: str
    """Its path, for messages."""
    weight: torch.nn.Parameter
    """(..., d_in) weight: an ``nn.Linear``'s (out, d), a router's (E, d), experts' (E, 2I, d)."""
    bias: torch.nn.Parameter | None
    """Its bias (..., out), or None."""
    trainable_bias_term: bool = False
    """True for a LoRA ``A`` matrix: a norm bias cannot fold into it (``B A beta`` changes as they train)."""


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def fold_targets(module: torch.nn.Module, param_name: str, where: str) -> list[FoldTarget]:
    """The tensors to scale when ``module.<param_name>`` consumes a norm's output.

    A PEFT LoRA layer contributes its base layer's weight and every adapter's ``lora_A`` weight
    (``B A (alpha * z) = B (A diag(alpha)) z``; LoRA dropout is element-wise, so it commutes).

    Raises:
        FoldError: DoRA (its row norms of ``W + B A`` change under the fold), a non-float weight (a
            quantised base layer), or a missing parameter.
    """
    if _is_lora_layer(module):
        if any(bool(v) for v in getattr(module, "use_dora", {}).values()):
            raise FoldError(
                f"{where} uses DoRA, whose weight-norm scaling is not invariant under folding a norm's weight into it: "
                "set long_seq.approx_bp.norm=null, or use plain LoRA"
            )
        if getattr(module, "lora_embedding_A", None):
            raise FoldError(f"{where} has LoRA embedding adapters: cannot fold a norm's weight into it")
        base = module.get_base_layer()
        targets = fold_targets(base, param_name, f"{where}.base_layer")
        for name, lora_a in module.lora_A.items():
            targets.append(FoldTarget(f"{where}.lora_A.{name}", lora_a.weight, None, trainable_bias_term=True))
        return targets
    weight = getattr(module, param_name, None)
    if not isinstance(weight, torch.nn.Parameter):
        raise FoldError(
            f"{where}.{param_name} is not a parameter ({type(module).__name__}): cannot fold a norm's weight into it"
        )
    if hasattr(weight, "quant_state") or hasattr(weight, "SCB"):
        # bitsandbytes' Params4bit / Int8Params: packed codes (4-bit ones may be stored as floats, with
        # bnb_4bit_quant_storage), which a norm's weight cannot be multiplied into
        raise FoldError(
            f"{where}.{param_name} is a bitsandbytes {'4-bit' if hasattr(weight, 'quant_state') else '8-bit'} "
            "quantised weight (QLoRA): folding a norm's weight needs float weights; set "
            "long_seq.approx_bp.norm=null (the approximate activations still apply)"
        )
    if not weight.is_floating_point():
        raise FoldError(
            f"{where}.{param_name} is {weight.dtype} (quantised?): folding a norm's weight needs float weights; "
            "set long_seq.approx_bp.norm=null"
        )
    bias = getattr(module, "bias", None) if param_name == "weight" else None
    return [FoldTarget(f"{where}.{param_name}", weight, bias if isinstance(bias, torch.nn.Parameter) else None)]


@torch.no_grad()
def fold_norm(norm_where: str, weight: torch.Tensor, bias: torch.Tensor | None, targets: list[FoldTarget]) -> None:
    """Fold a norm's affine ``weight`` (d,) and ``bias`` (d,) into ``targets`` in place, then set them to 1 and 0.

    ``W~ = W diag(weight)`` and ``b~ = W bias + b`` (paper Eqn. (17)), computed in float32 (float64
    for float64 weights) and rounded once to each tensor's dtype.

    Raises:
        FoldError: a target's last dim is not d, or a nonzero norm bias meets a target without a bias
            (or a LoRA ``A``): the sum would need a bias the stock class does not have.
    """
    d = weight.shape[-1]
    for t in targets:
        if t.weight.shape[-1] != d:
            raise FoldError(
                f"{t.where} has {t.weight.shape[-1]} input features but {norm_where} normalises {d}: not its consumer"
            )
    has_bias = bias is not None and bool((bias != 0).any())
    if has_bias:
        for t in targets:
            if t.bias is None:
                raise FoldError(
                    f"{norm_where} has a bias, which folds into the next layer's bias, but {t.where} has none"
                    + (" (a LoRA A matrix)" if t.trainable_bias_term else "")
                    + ": set long_seq.approx_bp.norm=null"
                )
    for t in targets:
        cdtype = torch.float64 if t.weight.dtype == torch.float64 else torch.float32
        w = t.weight.to(cdtype)
        if has_bias:
            t.bias.copy_((t.bias.to(cdtype) + w @ bias.to(cdtype)).to(t.bias.dtype))
        t.weight.copy_((w * weight.to(cdtype)).to(t.weight.dtype))
    weight.fill_(1.0)
    if bias is not None:
        bias.zero_()
