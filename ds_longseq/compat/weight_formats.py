"""Loaded weights in other formats: GGUF files (dequantized by transformers on load) and bitsandbytes' 4-bit linears.

Holds:
    drop_gguf_quantization_marker: a GGUF-loaded transformers model (dequantized on load, yet marked quantized and
        so refused by ``save_pretrained``) made a plain model.
    keep_4bit_weights_unpacked: bitsandbytes' 4-bit linears kept off their lossy CPU inference repacking.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "drop_gguf_quantization_marker",
    "keep_4bit_weights_unpacked",
]


def drop_gguf_quantization_marker(model_or_config) -> None:
    """A transformers model (or config) loaded with ``gguf_file=``: its weights are plain tensors, dequantized on
    load, but transformers 5.24 keeps ``config.quantization_config`` (quant_method "gguf") and the model's
    ``hf_quantizer``, and ``save_pretrained`` then refuses the model as not serializable. Both are dropped: the
    model is what it holds, a float model."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if model_or_config is not config:
        model_or_config.hf_quantizer = None
        model_or_config.is_quantized = False


def keep_4bit_weights_unpacked(model: Any) -> int:
    """Turn off, on each bitsandbytes ``Linear4bit`` of ``model``, the CPU inference repacking; returns how many.

    bitsandbytes 0.50's ``Linear4bit.forward``, on a CPU with avx512_bf16, in eval mode, for an input that does not
    require grad, replaces the module's packed weight in place by a CPU inference layout whose per-block scales are
    rounded to bfloat16 (``_convert_weight_packed_for_cpu``, undone only approximately). From then on every forward,
    training ones included, computes with other weights than dequant(W4), and some crash. transformers'
    ``from_pretrained`` returns models in eval mode, so any no-grad forward of a 4-bit model (an eval pass, a GRPO
    rollout, a probe) would change it silently. The switch is the module's own per-instance flag
    (``support_avx512bf16_for_cpu``, read at each forward); call this right after loading, before any forward.

    Raises:
        ValueError: a module was repacked already (its scales are rounded): load the model again.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # never imported: no module of ``model`` can be a bitsandbytes one
        return 0
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise ValueError(f"{name}: its 4-bit weight was already repacked for CPU inference (bfloat16 scales) by "
                             "a no-grad forward in eval mode: call keep_4bit_weights_unpacked before any forward")
        module.support_avx512bf16_for_cpu = False
        count += 1
    return count
