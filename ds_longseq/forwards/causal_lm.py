"""Forward of a ``*ForCausalLM`` under ds_longseq: the loss path, and the dispatch to the per-token path.

Holds:
    CausalLMForward: the callable installed as the model instance's ``forward``: finds packed documents
        once per forward (``ops.documents.find_documents``), computes the loss (chunked head, or the stock
        head's logits under sequence parallelism, with the mixture-of-experts auxiliary loss), and hands
        per-token and TRL fused-head calls to ``forwards.token_outputs``.
    LMHeadLossForward: the callable installed as the LM head's ``forward``: logits, or with
        ``targets=`` the chunked (loss_sum, num_valid) or per-token log-probs. Going through the
        head module's own call lets DeepSpeed ZeRO-3's module hooks gather its weight once per
        forward and once per backward, instead of once per chunk.

``model(..., labels=labels, return_token_logprobs=True)`` (``return_token_entropy=True`` for the
entropies too) returns an ``ops.objectives.TokenLogprobs`` instead of a loss: ``logprobs[b, t] =
log p(labels[b, t + 1] | tokens <= t)`` at positions whose next label is not -100 (the targets the
loss would use, shifted as the loss shifts them), the input of DPO / GRPO objectives.

``model(..., labels=labels, fused_lm_head=True)`` is TRL's fused-LM-head call (TRL >= 1.16, its
``add_fused_lm_head``): it returns a ``token_outputs.FusedLMHeadOutput`` with TRL's field names, computed by
the chunked head, so TRL's trainers get ds_longseq's head, chunk size and sequence-parallel
handling. What TRL configured when it added its head (the temperature, the per-token fields its
trainer reads, ``cast_lm_head_to_fp32``) is set with :meth:`CausalLMForward.configure_fused_head`
(``patch.configure_fused_lm_head``; the Trainer integration does it from the TRL trainer).

TRL 1.9's SFTTrainer (``loss_type="chunked_nll"``) instead makes plain loss calls and reads sums of the targets'
entropies and top-1 hits from their output: with :meth:`CausalLMForward.report_loss_statistics` on
(``patch.configure_loss_statistics``) every loss call returns a ``token_outputs.LossStatisticsOutput``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from ds_longseq.compat import cache_kwarg, pop_cache
from ds_longseq.forwards.attention_interface import mask_audit
from ds_longseq.forwards.attn_spec import SPEC_KWARG, AttentionSettings, AttnSpec
from ds_longseq.forwards.moe import router_aux_loss, router_aux_loss_wanted, with_router_aux_loss
from ds_longseq.forwards.token_outputs import (  # re-exported: they were defined here
    FUSED_HEAD_OUTPUTS,
    FusedHeadSettings,
    FusedLMHeadOutput,
    TokenOutputs,
    check_token_outputs_call,
)
from ds_longseq.ops.documents import find_documents, mask_document_starts
from ds_longseq.ops.lm_head_loss import chunked_lm_head_loss, chunked_token_outputs, shift_causal_labels, softcap_logits
from ds_longseq.ops.objectives import TokenLogprobs

if TYPE_CHECKING:
    from ds_longseq.forwards.sp_model import SequenceParallel

__all__ = [
    "CausalLMForward", "CausalLMSettings", "LMHeadLossForward", "FusedLMHeadOutput", "FusedHeadSettings",
    "FUSED_HEAD_OUTPUTS",
]


def _check_loss_call(sp, kwargs: dict, logits_to_keep) -> None:
    """Refuse a loss call ds_longseq's loss path cannot compute exactly: labels shifted per shard under sequence
    parallelism, or ``logits_to_keep`` (the loss needs every position)."""
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


class LMHeadLossForward:
    """Replacement ``forward`` of the LM head (an ``nn.Linear``) instance.

    ``head(hidden)`` is the stock linear (logits); ``head(hidden, targets=t)`` returns
    ``(loss_sum, num_valid)`` of the chunked cross entropy against already-shifted (B, T) targets;
    ``head(hidden, targets=t, per_token=True, outputs=(...), temperature=...)`` returns the
    ``TokenHeadOutputs`` of :func:`chunked_token_outputs`.
    """

    def __init__(self, head: torch.nn.Linear, orig_forward: Callable, chunk_size: int, softcap: float | None = None,
                 logit_scale: float = 1.0):
        self.head = head
        self.orig_forward = orig_forward
        self.chunk_size = chunk_size
        # the family's factor on the logits and final-logit softcap, applied inside the chunked loss
        self.softcap = softcap
        self.logit_scale = logit_scale

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
        common = dict(chunk_size=self.chunk_size, bias=head.bias, ignore_index=ignore_index, softcap=self.softcap,
                      logit_scale=self.logit_scale)
        targets = targets.to(hidden.device)
        if per_token:
            return chunked_token_outputs(
                hidden, head.weight, targets, outputs=outputs, temperature=temperature, **common
            )
        return chunked_lm_head_loss(hidden, head.weight, targets, **common)


@dataclasses.dataclass(frozen=True)
class CausalLMSettings:
    """What :class:`CausalLMForward` needs of the ``long_seq`` config and of the model's family."""

    streambp: bool
    """``streambp.enabled``: the layers stream, and take packed documents' starts from the model forward."""
    offload: bool
    """``long_seq.offload`` keeps the layer inputs."""
    chunked_head: bool
    """``lm_head.enabled``: the loss goes through the chunked head."""
    attention: AttentionSettings
    """``long_seq.attention``, passed to the layers with the documents."""
    final_logit_softcap: float | None = None
    """The family's cap on the logits (Gemma 2's), or None."""
    decoder: torch.nn.Module | None = None
    """Where the family keeps its decoder (families/decoder.py); None: ``model.model``."""
    head: torch.nn.Module | None = None
    """Where it keeps its LM head; None: ``model.lm_head``."""
    moe_aux: bool | None = None
    """Whether the family's own forward adds a load-balancing loss (families/discovery.py's "moe_aux" head); None:
    whenever the model has ``router_aux_loss_coef``."""
    logit_scale: float = 1.0
    """The family's factor on the logits after the head (1.0: none)."""
    stock_masks_see_packed_rows: bool = True
    """Whether the family's stock attention keeps packed documents apart (its decoder gives transformers' mask
    builders the position ids: ``families.discovery.masks_see_packed_rows``); ds_longseq's own attention does."""
    recurrent_mixers: bool = False
    """Layers with a linear-attention / state-space / short-convolution mixer (``DecoderLMAdapter.mixer``)."""
    sliding_masks_read: bool = True
    """Whether any layer reads the sliding-window masks the stock forward builds
    (``DecoderLMAdapter.sliding_masks_read``): if none does, the mask audit lets those masks go unused, as stock
    does."""


class CausalLMForward:
    """Replacement ``forward`` of one ``*ForCausalLM`` instance.

    With ``labels`` and the chunked LM head enabled, returns ``CausalLMOutputWithPast(loss=...,
    logits=None)``: the (B x T x V) logits are never formed. Without labels, or when generating
    (``past_key_values`` given or ``use_cache=True``), calls the stock forward. Under StreamBP or with
    offloaded layer inputs a training call defaults to ``use_cache=False`` (the stock default would keep
    every layer's K/V).

    Packed documents are found here, once per forward (:func:`~ds_longseq.ops.documents.find_documents`):
    their first labels are masked, and under StreamBP every layer gets them as
    ``ds_longseq=AttnSpec(doc_start=...)`` through the model forward's ``**kwargs``.

    Under sequence parallelism (``sp``) the labels must come pre-shifted as ``shift_labels`` (the
    shift crosses shard boundaries: ``engine.shard_batch`` does it before cutting) and the loss is
    the token-weighted mean over the whole group (:meth:`SequenceParallel.token_mean`), with or
    without the chunked LM head.

    What it needs of the ``long_seq`` config and of the family comes as one :class:`CausalLMSettings`
    (``patch.enable`` fills it in).
    """

    def __init__(self, model: torch.nn.Module, orig_forward: Callable, settings: CausalLMSettings,
                 sp: "SequenceParallel | None" = None):
        self.model = model
        self.orig_forward = orig_forward
        self.sp = sp
        self.settings = settings
        self.decoder = model.model if settings.decoder is None else settings.decoder
        self.head = model.lm_head if settings.head is None else settings.head
        self.token_outputs = TokenOutputs(self.head, settings.chunked_head, settings.final_logit_softcap,
                                          settings.logit_scale)
        self.token_records: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """While not None (:meth:`recording_tokens`), every loss call appends its targets' (log-probs, valid mask)."""
        self.loss_statistics = False
        """Loss calls return a ``LossStatisticsOutput`` (:meth:`report_loss_statistics`)."""

    @contextlib.contextmanager
    def recording_tokens(self):
        """Context in which every call that computes a loss (the Trainer's, TRL's fused-head calls) also appends its
        targets' per-token log-probabilities and valid mask, (B, T) each, detached, to the list it yields: for
        evaluation metrics by position. The loss is the same (computed from those log-probs, without gradient)."""
        if self.token_records is not None:
            raise RuntimeError("recording_tokens is already active on this model")
        self.token_records = []
        try:
            yield self.token_records
        finally:
            self.token_records = None

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
        settings = FusedHeadSettings(temperature, tuple(outputs), bool(cast_lm_head_to_fp32))
        self.token_outputs.settings = settings
        return settings

    def report_loss_statistics(self, on: bool = True) -> None:
        """Make every loss call (``labels=``, or ``shift_labels=`` under sequence parallelism; not a fused-head or
        per-token call) return a :class:`~ds_longseq.forwards.token_outputs.LossStatisticsOutput`: the loss and the
        sums TRL 1.9's SFTTrainer reads under ``loss_type="chunked_nll"`` (valid targets, their entropies, their
        top-1 hits), computed from the targets' per-token outputs (chunked with ``long_seq.lm_head``)."""
        self.loss_statistics = bool(on)

    @property
    def fused_head(self) -> FusedHeadSettings:
        """What TRL's fused-head calls compute on this model (set by :meth:`configure_fused_head`)."""
        return self.token_outputs.settings

    @property
    def active_sp(self) -> "SequenceParallel | None":
        """The sequence-parallel group, unless paused (``SequenceParallel.paused``: whole sequences)."""
        return None if self.sp is None or self.sp.is_paused else self.sp

    def __call__(self, *args, **kwargs):
        # every sliding window the model builds a mask for must reach ds_longseq's attention (attention_interface.py)
        with mask_audit(sliding_masks_read=self.settings.sliding_masks_read):
            return self._forward(*args, **kwargs)

    def _forward(
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
        # transformers 5.24 passes the cache as cache= (generate() does), earlier releases as past_key_values=
        past_key_values = pop_cache(kwargs, past_key_values)
        if past_key_values is None and sp is None:
            position_ids, labels, use_cache = _packed_rows(
                self, position_ids, attention_mask, input_ids, inputs_embeds, labels, use_cache, kwargs
            )
        generating = past_key_values is not None or use_cache is True
        # The stock default (config.use_cache) would keep every layer's K/V, and with a cache the
        # layers run their stock forward: no streaming, nothing offloaded.
        if not generating and (self.settings.streambp or sp is not None or self.settings.offload):
            use_cache = False
        wants_loss = labels is not None or (sp is not None and kwargs.get("shift_labels") is not None)
        if per_token:
            check_token_outputs_call(generating, wants_loss)
        elif generating or not wants_loss or (
            not self.settings.chunked_head and sp is None and self.token_records is None and not self.loss_statistics
        ):
            return self.orig_forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{cache_kwarg(self.orig_forward): past_key_values},
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        _check_loss_call(sp, kwargs, logits_to_keep)
        router_aux = router_aux_loss_wanted(self.model, self.settings.moe_aux, kwargs, self.active_sp is not None)
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
            aux = router_aux_loss(self.model, outputs, attention_mask) if router_aux else None
            # no valid token: a finite 0 as TRL's own head gives, not 0 / 0
            mean = lambda total, valid: self._token_mean(total, valid, num_items_in_batch, empty_is_zero=True)
            coef = self.model.router_aux_loss_coef if aux is not None else 0.0
            out = self.token_outputs.fused(hidden, targets, ignore_index, shift_labels is None, mean, aux, coef)
            if self.token_records is not None:
                self.token_records.append((out.log_probs.detach(), out.label_mask))
            return out
        if per_token:
            out = self.token_outputs.per_token(hidden, targets, ignore_index, ("entropy",) if want_entropy else ())
            return TokenLogprobs(out.log_probs, out.mask, out.entropy, group=None if sp is None else sp.group)
        if self.loss_statistics:
            aux = router_aux_loss(self.model, outputs, attention_mask) if router_aux else None
            # no valid token: a finite 0 as TRL 1.9's own chunked loss gives, not 0 / 0
            mean = lambda total, valid: self._token_mean(total, valid, num_items_in_batch, empty_is_zero=True)
            coef = self.model.router_aux_loss_coef if aux is not None else 0.0
            output, log_probs, mask = self.token_outputs.loss_statistics(hidden, targets, ignore_index, mean, aux, coef)
            if self.token_records is not None:
                self.token_records.append((log_probs.detach(), mask))
            return output.to_tuple() if return_dict is False else output
        loss_sum, num_valid, logits = self._loss_sum(hidden, targets, ignore_index)
        loss = self._token_mean(loss_sum, num_valid, num_items_in_batch)
        if router_aux:
            output = with_router_aux_loss(self.model, loss, logits, outputs, attention_mask)
        else:
            output = CausalLMOutputWithPast(
                loss=loss,
                logits=logits,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
            )
        return output.to_tuple() if return_dict is False else output

    def _loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        """(summed loss, number of valid targets, logits or None) of a loss call: the chunked head's, or under
        sequence parallelism with the stock head its logits' (returned, as the stock forward returns them); an
        evaluation recording its tokens (:meth:`recording_tokens`) computes it from the per-token log-probs."""
        if self.token_records is not None and not torch.is_grad_enabled():  # evaluation recording its tokens
            out = self.token_outputs.per_token(hidden, targets, ignore_index, ())
            self.token_records.append((out.log_probs, out.mask))
            return -out.log_probs.sum(), out.mask.sum(), None
        if self.settings.chunked_head:
            loss_sum, num_valid = self.head(hidden, targets=targets, ignore_index=ignore_index)
            return loss_sum, num_valid, None
        # sequence parallel with the stock head: its logits, a summed loss, the group's mean in the caller
        logits = self.head(hidden)
        if self.settings.logit_scale != 1.0:  # as the stock forward does after its head
            logits = logits * self.settings.logit_scale
        if self.settings.final_logit_softcap is not None:
            logits = softcap_logits(logits, self.settings.final_logit_softcap)
        targets = targets.to(logits.device)
        # float32 like the stock loss, but never below the model's own precision (float64 stays)
        loss_dtype = torch.promote_types(logits.dtype, torch.float32)
        loss_sum = F.cross_entropy(
            logits.to(loss_dtype).flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum"
        )
        return loss_sum, (targets != ignore_index).sum(), logits

    # The HF Trainer keeps only the dataset columns model.forward's signature names (and TRL reads it
    # too): without this, (*args, **kwargs) would make it drop input_ids.
    __call__.__signature__ = inspect.signature(_forward)

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


def _packed_rows(forward: CausalLMForward, position_ids, attention_mask, input_ids, inputs_embeds, labels, use_cache,
                 kwargs: dict):
    """(position ids, labels, use_cache) for a packed batch (found once per forward, ``_documents``): the
    StreamBP layers get the documents through ``kwargs`` (``ds_longseq=AttnSpec(doc_start=...)``), each
    document's first label is masked, and no cache is made (with one, transformers attends across the
    documents). Refused where the model's stock path would attend across them. Unchanged for unpacked rows."""
    doc_start, position_ids = _documents(position_ids, attention_mask, input_ids, inputs_embeds, kwargs)
    if forward.settings.streambp:
        # The StreamBP layers take the documents from here (None: no row is packed) instead of
        # finding them again, with host syncs, in every layer. transformers' model forward
        # passes its **kwargs on to every decoder layer.
        kwargs[SPEC_KWARG] = AttnSpec(None, forward.settings.attention, doc_start=doc_start)
    if doc_start is None:
        return position_ids, labels, use_cache
    if forward.settings.recurrent_mixers:
        raise NotImplementedError(
            f"packed documents on {type(forward.model).__name__}: its linear-attention / state-space layers "
            "carry their state across document starts in transformers' torch path (nothing resets it "
            "there), so each document would start from the previous one's state. Send one document per "
            "row"
        )
    if not forward.settings.streambp and not forward.settings.stock_masks_see_packed_rows:
        raise NotImplementedError(
            f"packed documents on {type(forward.model).__name__} without long_seq.streambp: its decoder "
            "builds its stock attention masks without the position ids, so transformers' attention would "
            "attend across the documents. Enable long_seq.streambp (ds_longseq's attention keeps each "
            "document to itself) or send one document per row"
        )
    if use_cache:
        raise ValueError(
            "packed documents with use_cache=True: with a cache transformers ignores the document "
            "boundaries and attends across them. Pass use_cache=False for packed rows"
        )
    if labels is not None:
        labels = mask_document_starts(labels, doc_start, kwargs.get("ignore_index", -100))
    # The stock default (config.use_cache) would create a cache, and with one transformers'
    # own attention (the paths ds_longseq leaves stock) attends across the documents.
    return position_ids, labels, False


def _documents(position_ids, attention_mask, input_ids, inputs_embeds, kwargs):
    """(doc_start (B, T) or None, position ids to run with) of a packed batch (``ops.documents.find_documents``).

    Labels are masked by the caller at each document's first token, so no target crosses a boundary.
    Under sequence parallelism ``engine.shard_batch`` does this on the whole sequence instead.
    """
    B, T = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    return find_documents(position_ids, attention_mask, B, T, cu_q, cu_k)
