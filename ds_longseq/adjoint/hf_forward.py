"""The adjoint-sharding training forward of a transformers SSM causal LM (Mamba-1 / Mamba-2).

Holds:
    HFAdjointForward: installed as the model instance's ``forward`` by ``ds_longseq.enable`` with
        ``long_seq.adjoint`` (``techniques.adjoint``).
"""

from __future__ import annotations

import torch
from torch import nn

from ds_longseq.families.residual_ssm import check_right_padded

__all__ = ["HFAdjointForward"]


class HFAdjointForward:
    """Replacement ``forward`` of a transformers SSM causal LM with ``long_seq.adjoint``: a training call
    (labels given, grad enabled) returns the adjoint-sharding loss and no logits; every other call
    (evaluation, generation) goes to the model's own forward."""

    def __init__(self, model: nn.Module, original, plan):
        self.model, self.original, self.plan = model, original, plan

    def __call__(self, input_ids=None, attention_mask=None, inputs_embeds=None, cache_params=None, labels=None,
                 output_hidden_states=None, return_dict=None, use_cache=None, logits_to_keep=0, **kwargs):
        if labels is None or not torch.is_grad_enabled():
            return self.original(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                 cache_params=cache_params, labels=labels, output_hidden_states=output_hidden_states,
                                 return_dict=return_dict, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                 **kwargs)
        unsupported = {name: value for name, value in [
            ("inputs_embeds", inputs_embeds), ("cache_params", cache_params),
            ("output_hidden_states", output_hidden_states or None), ("use_cache", use_cache or None),
            ("logits_to_keep", logits_to_keep or None), *kwargs.items()] if value is not None}
        if unsupported:
            raise ValueError(
                f"long_seq.adjoint training forward takes input_ids, labels and a right-padding attention_mask only; "
                f"got {sorted(unsupported)}: drop them (the loss is the mean over labels != -100)"
            )
        check_right_padded(attention_mask)
        loss = self.plan.loss(self.model, input_ids, labels)
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=loss, logits=None)
