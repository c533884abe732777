"""Checks that a module recomputed in backward (StreamBP layer replay, mini-sequence MLP) computes
the same function the second time.

Holds:
    check_no_active_dropout: raise if a training module contains dropout with p > 0.
"""

from __future__ import annotations

import torch

__all__ = ["check_no_active_dropout"]

_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout)


def check_no_active_dropout(module: torch.nn.Module, feature: str) -> None:
    """Raise if ``module`` (in training mode, under grad) holds a dropout module with p > 0.

    ``feature`` (e.g. "long_seq.streambp") recomputes the module in backward without replaying the
    random numbers, so its gradient would belong to different dropout masks than its forward: a
    silently wrong gradient. Config-level dropout fields are refused at ``enable()``; this catches
    dropout modules added later or not named in the config, such as PEFT's ``lora_dropout``.
    """
    if not (module.training and torch.is_grad_enabled()):
        return
    for name, sub in module.named_modules():
        if isinstance(sub, _DROPOUT) and sub.p > 0 and sub.training:
            raise ValueError(
                f"{type(module).__name__}.{name} is a dropout with p={sub.p}: {feature} recomputes "
                f"{type(module).__name__} in backward and cannot redraw its dropout masks (the gradient would be "
                "wrong). Set that dropout to 0 (for LoRA: LoraConfig(lora_dropout=0.0)), or call model.eval()"
            )
