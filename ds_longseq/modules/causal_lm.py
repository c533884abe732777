"""Forward of a ``*ForCausalLM`` whose loss is computed by the chunked LM head.

Holds:
    CausalLMForward: the callable installed as the model instance's ``forward``.
    LMHeadLossForward: the callable installed as the LM head's ``forward``: logits, or with
        ``targets=`` the chunked (loss_sum, num_valid) or per-token log-probs. Going through the
        head module's own call lets DeepSpeed ZeRO-3's module hooks gather its weight once per
        forward and once per backward, instead of once per chunk.

``model(..., labels=labels, return_token_logprobs=True)`` (``return_token_entropy=True`` for the
entropies too) returns an ``ops.objectives.TokenLogprobs`` instead of a loss: ``logprobs[b, t] =
log p(labels[b, t + 1] | tokens <= t)`` at positions whose next label is not -100 (the targets the
loss would use, shifted as the loss shifts them), the input of DPO / GRPO objectives.

``model(..., labels=labels, fused_lm_head=True)`` is TRL's fused-LM-head call (TRL >= 1.16, its
``add_fused_lm_head``): it returns a :class:`FusedLMHeadOutput` with TRL's field names, computed by
the chunked head, so TRL's trainers get ds_longseq's head, chunk size and sequence-parallel
handling. What TRL configured when it added its head (the temperature, the per-token fields its
trainer reads, ``cast_lm_head_to_fp32``) is set with :meth:`CausalLMForward.configure_fused_head`
(``patch.configure_fused_lm_head``; the Trainer integration does it from the TRL trainer).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput, MoeCausalLMOutputWithPast

from ds_longseq.config import LongSeqConfig
from ds_longseq.modules.attn_spec import SPEC_KWARG, AttnSpec
from ds_longseq.ops.lm_head_loss import (
    TokenHeadOutputs,
    chunked_lm_head_loss,
    chunked_token_outputs,
    shift_causal_labels,
    softcap_logits,
)
from ds_longseq.ops.objectives import TokenLogprobs
from ds_longseq.ops.packing import doc_starts, mask_document_starts

if TYPE_CHECKING:
    from ds_longseq.modules.sequence_parallel import SequenceParallel

__all__ = ["CausalLMForward", "LMHeadLossForward", "FusedLMHeadOutput", "FusedHeadSettings", "FUSED_HEAD_OUTPUTS"]

FUSED_HEAD_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused head (``add_fused_lm_head(outputs=...)``) ds_longseq computes."""

# TRL's field names -> the chunked head's (``ops.lm_head_loss.TOKEN_HEAD_OUTPUTS``)
_HEAD_OUTPUT_NAMES = {"entropy": "entropy", "is_top1": "top1", "mean_logits": "mean_logits",
                      "log_sum_sq_probs": "log_sum_sq_probs"}


@dataclass(frozen=True)
class FusedHeadSettings:
    """What a fused-LM-head call computes: TRL's ``add_fused_lm_head`` arguments.

    Attributes:
        temperature: the logits (after the final-logit softcap) are divided by it before the softmax;
            every field, the loss and the gradients are those of the scaled distribution.
        outputs: the per-token fields of :data:`FUSED_HEAD_OUTPUTS` to compute (``log_probs`` always is;
            the others are None when not listed, as in TRL).
        cast_lm_head_to_fp32: project the final hidden states through the head in float32, outside
            autocast (GRPO's ``cast_lm_head_to_fp32``).
    """

    temperature: float = 1.0
    outputs: tuple[str, ...] = ("log_probs", "entropy", "is_top1")  # what TRL's SFTTrainer reads
    cast_lm_head_to_fp32: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            self.temperature > 0
        ):
            raise ValueError(f"fused LM head temperature must be a positive number, got {self.temperature!r}")
        if isinstance(self.outputs, str):
            raise ValueError(f"fused LM head outputs must be a tuple of field names, got the string {self.outputs!r}")
        unknown = [name for name in self.outputs if name not in FUSED_HEAD_OUTPUTS]
        if unknown:
            raise ValueError(
                f"fused LM head outputs {unknown} not computed by ds_longseq: choose among {list(FUSED_HEAD_OUTPUTS)}"
            )
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def head_outputs(self) -> tuple[str, ...]:
        """The requested optional fields under the chunked head's names."""
        return tuple(_HEAD_OUTPUT_NAMES[name] for name in self.outputs if name != "log_probs")


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """What TRL's fused-LM-head call (``fused_lm_head=True``) returns, field for field.

    Shapes: (B, T - 1) with ``labels`` (shifted as the loss shifts them), (B, T) with pre-shifted
    ``shift_labels``; every per-token field is 0 / False where the label is ignored.

    Attributes:
        loss: the mean negative log-likelihood (over ``num_items_in_batch`` when given, else the
            valid tokens; the group's under sequence parallelism), plus the weighted MoE
            load-balancing loss when router logits are requested.
        log_probs: log-probability of each next-token label, differentiable.
        entropy: entropy of each next-token distribution, differentiable.
        is_top1: whether the label has the largest logit.
        label_mask: whether the label is valid.
        aux_loss: the MoE load-balancing loss, when requested.
        log_sum_sq_probs: log sum_v p_v^2 of each next-token distribution, no gradient.
        mean_logits: mean over the vocabulary of each position's logits (after the final-logit
            softcap, divided by the temperature), no gradient.

    ``entropy``, ``is_top1``, ``log_sum_sq_probs`` and ``mean_logits`` are computed when requested
    (:class:`FusedHeadSettings` ``outputs``, as TRL's ``add_fused_lm_head(outputs=...)``), else None.
    Every field and the loss are those of the temperature-scaled distribution.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class LMHeadLossForward:
    """Replacement ``forward`` of the LM head (an ``nn.Linear``) instance.

    ``head(hidden)`` is the stock linear (logits); ``head(hidden, targets=t)`` returns
    ``(loss_sum, num_valid)`` of the chunked cross entropy against already-shifted (B, T) targets;
    ``head(hidden, targets=t, per_token=True, outputs=(...), temperature=...)`` returns the
    ``TokenHeadOutputs`` of :func:`chunked_token_outputs`.
    """

    def __init__(self, head: torch.nn.Linear, orig_forward: Callable, chunk_size: int, softcap: float | None = None):
        self.head = head
        self.orig_forward = orig_forward
        self.chunk_size = chunk_size
        self.softcap = softcap  # the family's final-logit softcap, applied inside the chunked loss

    def __call__(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
        per_token: bool = False,
        outputs: tuple[str, ...] = (),
        temperature: float = 1.0,
    ):
        if targets is None:
            return self.orig_forward(hidden)
        head = self.head
        common = dict(chunk_size=self.chunk_size, bias=head.bias, ignore_index=ignore_index, softcap=self.softcap)
        targets = targets.to(hidden.device)
        if per_token:
            return chunked_token_outputs(
                hidden, head.weight, targets, outputs=outputs, temperature=temperature, **common
            )
        return chunked_lm_head_loss(hidden, head.weight, targets, **common)


class CausalLMForward:
    """Replacement ``forward`` of one ``*ForCausalLM`` instance.

    With ``labels`` and the chunked LM head enabled, returns ``CausalLMOutputWithPast(loss=...,
    logits=None)``: the (B x T x V) logits are never formed. Without labels, or when generating
    (``past_key_values`` given or ``use_cache=True``), calls the stock forward. Under StreamBP or with
    offloaded layer inputs a training call defaults to ``use_cache=False`` (the stock default would keep
    every layer's K/V).

    Packed documents are found here, once per forward (:func:`~ds_longseq.ops.packing.doc_starts`):
    their first labels are masked, and under StreamBP every layer gets them as
    ``ds_longseq=AttnSpec(doc_start=...)`` through the model forward's ``**kwargs``.

    Under sequence parallelism (``sp``) the labels must come pre-shifted as ``shift_labels`` (the
    shift crosses shard boundaries: ``engine.shard_batch`` does it before cutting) and the loss is
    the token-weighted mean over the whole group (:meth:`SequenceParallel.token_mean`), with or
    without the chunked LM head.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        orig_forward: Callable,
        config: LongSeqConfig,
        sp: "SequenceParallel | None" = None,
        final_logit_softcap: float | None = None,
        decoder: torch.nn.Module | None = None,
        head: torch.nn.Module | None = None,
    ):
        self.model = model
        self.orig_forward = orig_forward
        self.config = config
        self.sp = sp
        self.final_logit_softcap = final_logit_softcap
        # where the family keeps them (models/adapters.py); the stock layout by default
        self.decoder = model.model if decoder is None else decoder
        self.head = model.lm_head if head is None else head
        self.fused_head = FusedHeadSettings()

    def configure_fused_head(
        self,
        *,
        temperature: float = 1.0,
        outputs: tuple[str, ...] = FusedHeadSettings.outputs,
        cast_lm_head_to_fp32: bool = False,
    ) -> FusedHeadSettings:
        """Set what ``fused_lm_head=True`` calls compute: the arguments TRL gave ``add_fused_lm_head``
        for this model (see :class:`FusedHeadSettings`; the TRL trainer's own head is shadowed by
        this forward, so its settings must be repeated here). Other calls are unaffected.

        Raises:
            ValueError: a non-positive temperature or an output ds_longseq does not compute.
        """
        self.fused_head = FusedHeadSettings(temperature, tuple(outputs), bool(cast_lm_head_to_fp32))
        return self.fused_head

    @property
    def active_sp(self) -> "SequenceParallel | None":
        """The sequence-parallel group, unless paused (``SequenceParallel.paused``: whole sequences)."""
        return None if self.sp is None or self.sp.is_paused else self.sp

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ):
        sp = self.active_sp
        # TRL's padding-free collator adds each token's document index for the short convolutions of
        # linear-attention layers; no supported family has one, and ds_longseq's attention refuses
        # arguments it does not implement
        kwargs.pop("seq_idx", None)
        fused = bool(kwargs.pop("fused_lm_head", False))  # TRL's call: per-token outputs, its field names
        want_entropy = bool(kwargs.pop("return_token_entropy", False)) or fused
        per_token = bool(kwargs.pop("return_token_logprobs", False)) or want_entropy
        if past_key_values is None and sp is None:
            doc_start, position_ids = self._documents(position_ids, attention_mask, input_ids, inputs_embeds, kwargs)
            if self.config.streambp.enabled:
                # The StreamBP layers take the documents from here (None: no row is packed) instead of
                # finding them again, with host syncs, in every layer. transformers' model forward
                # passes its **kwargs on to every decoder layer.
                kwargs[SPEC_KWARG] = AttnSpec(None, self.config.streambp.kv_block_size, doc_start=doc_start)
            if doc_start is not None:
                if use_cache:
                    raise ValueError(
                        "packed documents with use_cache=True: with a cache transformers ignores the document "
                        "boundaries and attends across them. Pass use_cache=False for packed rows"
                    )
                # The stock default (config.use_cache) would create a cache, and with one transformers'
                # own attention (the paths ds_longseq leaves stock) attends across the documents.
                use_cache = False
                if labels is not None:
                    labels = mask_document_starts(labels, doc_start, kwargs.get("ignore_index", -100))
        generating = past_key_values is not None or use_cache is True
        # The stock default (config.use_cache) would keep every layer's K/V, and with a cache the
        # layers run their stock forward: no streaming, nothing offloaded.
        if not generating and (
            self.config.streambp.enabled or sp is not None or self.config.offload.layer_inputs is not None
        ):
            use_cache = False
        wants_loss = labels is not None or (sp is not None and kwargs.get("shift_labels") is not None)
        if per_token:
            _check_token_logprobs_call(generating, wants_loss)
        elif generating or not wants_loss or (not self.config.lm_head.enabled and sp is None):
            return self.orig_forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        if sp is not None and kwargs.get("shift_labels") is None:
            raise ValueError(
                "under sequence parallelism pass shift_labels= (labels shifted once over the whole sequence, then "
                "cut like input_ids), not labels=: shifting a shard locally loses the label at every shard boundary. "
                "ds_longseq.engine.shard_batch(batch, ...) returns shift_labels."
            )
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError(
                "logits_to_keep cannot be combined with labels under ds_longseq lm_head chunking or sequence "
                "parallelism (the loss needs every position): drop logits_to_keep"
            )
        router_aux = self._router_aux_loss_wanted(kwargs)
        return_dict = kwargs.pop("return_dict", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        outputs = self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            **kwargs,
        )
        targets = shift_labels if shift_labels is not None else shift_causal_labels(labels, ignore_index)
        if sp is not None:  # packed rows: the documents' boundaries are known once the forward ran
            targets = sp.mask_boundary_targets(targets.to(outputs.last_hidden_state.device), ignore_index)
        hidden = outputs.last_hidden_state
        if fused:
            aux = self._router_aux_loss(outputs, attention_mask) if router_aux else None
            return self._fused_output(hidden, targets, ignore_index, num_items_in_batch, shift_labels is None, aux)
        if per_token:
            out = self._per_token(hidden, targets, ignore_index, ("entropy",) if want_entropy else ())
            return TokenLogprobs(out.log_probs, out.mask, out.entropy, group=None if sp is None else sp.group)
        logits = None
        if self.config.lm_head.enabled:
            loss_sum, num_valid = self.head(hidden, targets=targets, ignore_index=ignore_index)
        else:  # sequence parallel with the stock head: its logits, a summed loss, the group's mean below
            logits = self.head(hidden)
            if self.final_logit_softcap is not None:  # as the stock forward does after its head
                logits = softcap_logits(logits, self.final_logit_softcap)
            targets = targets.to(logits.device)
            # float32 like the stock loss, but never below the model's own precision (float64 stays)
            loss_dtype = torch.promote_types(logits.dtype, torch.float32)
            loss_sum = F.cross_entropy(
                logits.to(loss_dtype).flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum"
            )
            num_valid = (targets != ignore_index).sum()
        loss = self._token_mean(loss_sum, num_valid, num_items_in_batch)
        if router_aux:
            output = self._with_router_aux_loss(loss, logits, outputs, attention_mask)
        else:
            output = CausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                past_key_values=None,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        return output.to_tuple() if return_dict is False else output

    def _per_token(self, hidden, targets, ignore_index: int, outputs: tuple[str, ...], temperature: float = 1.0):
        """``TokenHeadOutputs`` of ``targets``, (B, T) each, with the ``outputs`` requested (names of
        ``ops.lm_head_loss.TOKEN_HEAD_OUTPUTS``): chunked, or from the stock head's logits."""
        if self.config.lm_head.enabled:
            return self.head(hidden, targets=targets, ignore_index=ignore_index, per_token=True, outputs=outputs,
                             temperature=temperature)
        # the stock head: (B, T, V) logits, as the user configured
        logits = self.head(hidden)
        if self.final_logit_softcap is not None:
            logits = softcap_logits(logits, self.final_logit_softcap)
        targets = targets.to(logits.device)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if temperature != 1.0:
            logits = logits / temperature
        log_p = torch.log_softmax(logits, dim=-1)
        mask = targets != ignore_index
        index = targets.clamp_min(0).unsqueeze(-1)
        logps = log_p.gather(-1, index).squeeze(-1) * mask
        ent = -(log_p.exp() * log_p).sum(-1) * mask if "entropy" in outputs else None
        hit = None
        if "top1" in outputs:
            hit = (logits.gather(-1, index).squeeze(-1) >= logits.amax(dim=-1)) & mask
        with torch.no_grad():  # statistics without gradient, as TRL's
            mean = logits.mean(-1) * mask if "mean_logits" in outputs else None
            sq = None
            if "log_sum_sq_probs" in outputs:
                sq = (torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1)) * mask
        return TokenHeadOutputs(logps, mask, ent, hit, mean, sq)

    def _fused_output(self, hidden, targets, ignore_index: int, num_items_in_batch, trim: bool, aux_loss):
        """TRL's fused-LM-head output, as :attr:`fused_head` configures it. ``trim``: the targets came
        from unshifted ``labels``, so the last position (never a target) is dropped, as TRL's own
        head returns (B, T - 1)."""
        if trim:
            hidden, targets = hidden[:, :-1], targets[:, :-1]
        settings = self.fused_head
        precision = contextlib.nullcontext()
        if settings.cast_lm_head_to_fp32:  # as TRL's head: float32 projection outside autocast
            hidden = hidden.float()
            precision = torch.autocast(hidden.device.type, enabled=False)
        with precision:
            out = self._per_token(hidden, targets, ignore_index, settings.head_outputs, settings.temperature)
        # no valid token: a finite 0 as TRL's own head gives, not 0 / 0
        loss = self._token_mean(-out.log_probs.sum(), out.mask.sum(), num_items_in_batch, empty_is_zero=True)
        if aux_loss is not None:
            loss = loss + self.model.router_aux_loss_coef * aux_loss.to(loss.device)
        return FusedLMHeadOutput(
            loss=loss, log_probs=out.log_probs, entropy=out.entropy, log_sum_sq_probs=out.log_sum_sq_probs,
            mean_logits=out.mean_logits, is_top1=out.top1, label_mask=out.mask, aux_loss=aux_loss,
        )

    def _token_mean(self, loss_sum, num_valid, num_items_in_batch, empty_is_zero: bool = False) -> torch.Tensor:
        """``loss_sum`` over ``num_items_in_batch`` when given, else over ``num_valid`` (at least 1 with
        ``empty_is_zero``); under sequence parallelism the group's (:meth:`SequenceParallel.token_mean`)."""
        sp = self.active_sp
        if sp is not None:
            return sp.token_mean(loss_sum, num_valid, num_items_in_batch)
        denominator = num_items_in_batch
        if denominator is None:
            denominator = num_valid.clamp(min=1) if empty_is_zero else num_valid
        if isinstance(denominator, torch.Tensor):
            denominator = denominator.to(loss_sum.device)
        return loss_sum / denominator

    def _router_aux_loss_wanted(self, kwargs: dict) -> bool:
        """Whether this forward adds a mixture-of-experts load-balancing loss, as the stock one would."""
        model = self.model
        if getattr(model, "router_aux_loss_coef", None) is None:
            return False  # a dense family
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            wanted = getattr(model.config, "output_router_logits", False)
        if wanted and self.active_sp is not None:
            raise NotImplementedError(
                "output_router_logits (the mixture-of-experts load-balancing loss) under sequence parallelism: each "
                "rank routes only its shard, so the loss would need the group's routing statistics. Pass "
                "output_router_logits=False (or set config.output_router_logits=False), or disable sequence_parallel"
            )
        return bool(wanted)

    def _router_aux_loss(self, outputs, attention_mask) -> torch.Tensor:
        """The family's own load-balancing loss (from its modeling module) on the recorded (B*T, E)
        router logits, as the stock forward computes it."""
        model = self.model
        balancing = sys.modules[type(model).__module__].load_balancing_loss_func
        return balancing(outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)

    def _with_router_aux_loss(self, loss, logits, outputs, attention_mask):
        """The stock MoE ending: ``loss + coef * load_balancing_loss(router_logits)``."""
        model = self.model
        aux_loss = self._router_aux_loss(outputs, attention_mask)
        return MoeCausalLMOutputWithPast(
            loss=loss + model.router_aux_loss_coef * aux_loss.to(loss.device),
            aux_loss=aux_loss,
            logits=logits,
            past_key_values=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )

    def _documents(self, position_ids, attention_mask, input_ids, inputs_embeds, kwargs):
        """(doc_start (B, T) or None, position ids to run with) of a packed batch, validated (clear errors).

        Without ``position_ids``, restarting ones are derived from ``cu_seq_lens_*``: transformers' own
        attention (the paths ds_longseq leaves stock) recognises documents only from them, and RoPE is
        relative, so a document's attention is the same at any offset. Labels are masked by the caller
        at each document's first token, so no target crosses a boundary. Under sequence parallelism
        ``engine.shard_batch`` does this on the whole sequence instead.
        """
        B, T = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        doc_start = doc_starts(
            position_ids, attention_mask, B, T, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        )
        if doc_start is not None and position_ids is None:
            position_ids = torch.arange(T, device=doc_start.device) - doc_start
        return doc_start, position_ids


def _check_token_logprobs_call(generating: bool, has_targets: bool) -> None:
    if generating:
        raise ValueError(
            "return_token_logprobs with a KV cache (past_key_values / use_cache=True): log-probs are for training "
            "and scoring; pass use_cache=False"
        )
    if not has_targets:
        raise ValueError(
            "return_token_logprobs needs the targets: pass labels= (shift_labels= under sequence parallelism) with "
            "-100 where no log-prob is wanted (the prompt, padding)"
        )
