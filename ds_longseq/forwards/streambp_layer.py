"""StreamBP forward for a stock Hugging Face decoder layer (any architecture that routes its K/V
through its KV cache's ``update``).

Holds:
    StreamBPLayerForward: the callable installed as a decoder layer's ``forward`` (streambp).
    LayerParts: what the family knows of the layer that the forward needs.

Shape legend: B batch, T sequence, C chunk, d hidden, D rotary dim.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable

import torch

from ds_longseq.compat import CHECKPOINTING_OFF_CALL, cache_kwarg, pop_cache
from ds_longseq.families.decoder import KV_SHARING_KWARG, PER_TOKEN_LAYER_INPUTS, RECURRENT_MASK_KWARGS
from ds_longseq.forwards.attn_spec import SPEC_KWARG, AttentionSettings, AttnSpec, chunk_spec
from ds_longseq.forwards.head_sharding_forward import HeadShardedMixerForward
from ds_longseq.forwards.layer_cache import layer_cache
from ds_longseq.forwards.moe import RouterTap, collection_paused, record_router_logits, router_logits_requested
from ds_longseq.forwards.replay import TOKEN_WISE_PROBE_TOKENS, check_token_wise, replay_draws
from ds_longseq.forwards.unread_outputs import PROBE_TOKENS, UnreadLinear, UnreadLinears
from ds_longseq.forwards.zero3 import check_zero3_leaf
from ds_longseq.ops.documents import PACKED_KWARGS, find_documents
from ds_longseq.ops.draws import generators_kept
from ds_longseq.ops.head_sharding import MixedStream, MixerStream, streambp_mixer_sp_apply
from ds_longseq.ops.kv_stream import SharedKV
from ds_longseq.ops.streambp_autograd import streambp_apply, streambp_sp_apply

if TYPE_CHECKING:
    from ds_longseq.forwards.auto_chunk import AutoChunkSize
    from ds_longseq.forwards.keep_attention import KeepAttentionOutput
    from ds_longseq.forwards.layer_input_offload import LayerInputOffload

__all__ = ["StreamBPLayerForward", "LayerParts"]


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """What the family knows of one decoder layer that its StreamBP forward needs (``techniques/streambp.py`` reads it
    off ``DecoderLMAdapter``)."""

    name: str | None = None
    """How errors name the layer (e.g. ``LlamaForCausalLM.model.layers[3]``); None: its class name."""
    router_tap: RouterTap | None = None
    """A mixture-of-experts layer's router logits (``forwards/moe.py``), or None."""
    kv_sharing: tuple[str, str, bool] | None = None
    """Cross-layer K/V sharing (``DecoderLMAdapter.kv_sharing``): ("store" | "reuse", key, whether a later layer
    reuses this key), or None."""
    streams: int | None = None
    """S when the layer takes its hidden states stacked as (S, B, T, d) (``DecoderLMAdapter.stacked_streams``)."""
    mixer: str | None = None
    """"recurrent" for a layer whose token mixer carries a state instead of attending (its padding mask is its
    chunk's own, its states are carried from chunk to chunk), "both" for one with an attention beside it,
    "token_wise" for one with no token mixer (``DecoderLMAdapter.token_wise``: nothing carried, checked once to mix
    no tokens), None for an attention layer (``DecoderLMAdapter.mixer``)."""
    mixer_module: torch.nn.Module | None = None
    """The recurrent mixer itself (under sequence parallelism it may be head-sharded:
    ``forwards.head_sharding_forward``)."""
    query_proj: UnreadLinear | None = None
    """The query projection as an installed ``UnreadLinear`` (``forwards.unread_outputs``): left uncomputed in the
    K/V capture once a probe found it exact."""
    output_proj: UnreadLinear | None = None
    """The MLP's output projection, likewise left uncomputed in the backward's chunk re-forward."""
    kv_projs: tuple[UnreadLinear, UnreadLinear] | None = None
    """The key and value projections, run for their gradient only in the replay of a chunk whose K/V the capture
    pass computed (the attention reuses those), once a probe found it exact."""


class StreamBPLayerForward:
    """Replacement ``forward`` of one decoder layer instance.

    Without a KV cache, runs the stock layer chunk by chunk through :func:`streambp_apply`
    (the forward keeps only the layer input; backward re-forwards chunks in reverse order).
    With a cache (generation), calls the stock forward unchanged: attention then goes through
    ``longseq_attention`` on the cached keys. With ``offload``, the saved input goes to host memory.

    Packed documents' starts come from the forward's ``ds_longseq=AttnSpec`` (``CausalLMForward``
    finds them once per forward; under sequence parallelism ``AttnSpec.sp`` holds the global ones).
    Called without one (``model.model(...)`` directly), the layer finds them itself.
    """

    def __init__(self, layer: torch.nn.Module, orig_forward: Callable, chunk_size: "int | AutoChunkSize",
                 attention: AttentionSettings, offload: "LayerInputOffload | None" = None,
                 parts: LayerParts | None = None, keep: "KeepAttentionOutput | None" = None):
        """``chunk_size``: ``long_seq.streambp.chunk_size``, or under "auto" the ``forwards/auto_chunk.AutoChunkSize``
        the layer asks at each forward (:attr:`chunk_size`); ``attention``: ``long_seq.attention`` (passed to every
        attention call of the layer); ``offload``: where the saved layer input goes; ``parts``: what the family knows
        of the layer (:class:`LayerParts`); ``keep``: whether the forward keeps the attention outputs for the
        backward (``forwards.keep_attention``, asked at each forward; None: never, a layer with a recurrent mixer).
        Every pass of a chunk draws the random numbers (dropout masks, router noise) its forward drew
        (``forwards.replay.replay_draws``)."""
        parts = parts or LayerParts()
        self.layer = layer
        self.name = parts.name or type(layer).__name__
        # the keyword the layer takes its cache by (cache from transformers 5.24, GPT-NeoX's layer_past)
        self.cache_kwarg = cache_kwarg(orig_forward)
        # the names positional arguments after the hidden states bind to (GPT-2 passes its cache by position)
        params = list(inspect.signature(orig_forward).parameters.values())[1:]
        self.positional_names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.orig_forward = orig_forward
        self.chunks = chunk_size
        self.attention = attention
        self.offload = offload
        self.keep = keep
        self.parts = parts  # read where used (self.parts.mixer), not copied field by field
        # a recurrent mixer's first forward over two chunks or more checks that it uses every carried state
        self.state_checked = self.parts.mixer not in ("recurrent", "both")
        # a layer with no token mixer is checked once to compute each token from its own input alone
        self.token_wise_checked = self.parts.mixer != "token_wise"
        # linears whose output a pass never reads: skipped there once its first training forward's probe found
        # the result bitwise the same (only plain attention layers are probed)
        probed = self.parts.mixer is None and self.parts.kv_sharing is None and self.parts.router_tap is None
        self.unread = UnreadLinears(parts.query_proj, parts.output_proj, parts.kv_projs) if probed else (
            UnreadLinears())

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk in this forward: the fixed ``long_seq.streambp.chunk_size``, or what the automatic chunk
        size chose for the forward running now (nothing writes into the layer)."""
        if isinstance(self.chunks, int):
            return self.chunks
        if self.chunks.chosen is None:
            raise RuntimeError(
                f"StreamBP: {self.name} has long_seq.streambp.chunk_size 'auto', which the model's forward chooses "
                "before its first layer runs: call the model, not this layer on its own, or set a chunk size"
            )
        return self.chunks.chosen

    def _bind_positional(self, args: tuple, kwargs: dict) -> dict:
        """``kwargs`` with the positional arguments after the hidden states added by their parameter names
        (Gemma 4 passes its per-layer input by position); refused where they cannot be named."""
        names = self.positional_names
        if len(args) > len(names) or any(n in kwargs for n in names[: len(args)]):
            raise NotImplementedError(
                f"StreamBP: {self.name} ({type(self.layer).__name__}) is called with {len(args)} positional "
                "argument(s) after the hidden states, which StreamBP cannot name from the layer's signature: this "
                "model cannot run under long_seq.streambp; use mini_seq"
            )
        return {**dict(zip(names, args, strict=False)), **kwargs}

    def __call__(
        self,
        hidden_states: torch.Tensor,
        *args,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # The whole forward's state, from the sequence-parallel forward hook or CausalLMForward.
        outer_spec = kwargs.pop(SPEC_KWARG, None)
        # Packed rows in the varlen form: turned into document starts here, not passed to the layer.
        packed = {name: kwargs.pop(name) for name in PACKED_KWARGS if name in kwargs}
        if args:
            kwargs = self._bind_positional(args, kwargs)
            attention_mask = kwargs.pop("attention_mask", attention_mask)
            position_ids = kwargs.pop("position_ids", position_ids)
            position_embeddings = kwargs.pop("position_embeddings", position_embeddings)
            use_cache = kwargs.pop("use_cache", use_cache)
        past_key_values = pop_cache(kwargs)  # whichever name the model passed it by (compat.CACHE_KWARGS)
        if past_key_values is not None:
            return self.orig_forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{self.cache_kwarg: past_key_values},
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **{SPEC_KWARG: AttnSpec(None, self.attention)},
                **kwargs,
            )
        call = self._prepare(hidden_states, attention_mask, position_ids, position_embeddings, outer_spec, packed,
                             kwargs)
        probe = None
        if self.unread.undecided and self.layer.training and torch.is_grad_enabled():
            probe = call.tokens.packed[:, :PROBE_TOKENS].detach().clone()  # probed once the forward ran its checks
        result = self._stream(call)
        if call.draws is not None:
            call.draws.advance()
        if probe is not None:
            # as one process would run the layer (the same computation; no collective inside)
            self.unread.probe(functools.partial(self._run_chunk, dataclasses.replace(call, sp=None)),
                              [p for p in self.layer.parameters() if p.requires_grad], probe)
        if call.role == "store":
            if call.sp is None:  # what the stock layer stores: its keys/values of the whole sequence
                call.shared_states[self.parts.kv_sharing[1]] = (call.share.k, call.share.v)
            if not self.parts.kv_sharing[2]:  # kept for the backward only when a later layer attends them
                call.share.release()
        if call.with_router_logits:
            result, logits = result
            record_router_logits(logits.flatten(0, 1))
        out = call.tokens.unpack_output(result)
        # as the stock layer returns it (Bamba's decoder unpacks (hidden states, attention weights)); its other
        # outputs were None in every chunk (_check_extra_outputs)
        returned = call.returned
        return (out, *[None] * (returned - 1)) if returned else out

    def _prepare(self, hidden_states, attention_mask, position_ids, position_embeddings, outer_spec, packed: dict,
                 kwargs: dict) -> "_LayerCall":
        """One training forward's state (:class:`_LayerCall`), every check that refuses what StreamBP cannot run
        made before any compute."""
        layer = self.layer
        sp = outer_spec.sp if outer_spec is not None else None
        tokens = _TokenInputs(self.name, layer, hidden_states, kwargs, self.parts.streams)
        B, T = tokens.batch_shape
        mixer_masks = {key: kwargs.pop(key) for key in RECURRENT_MASK_KWARGS if key in kwargs}  # cut per chunk
        shared_states = kwargs.pop(KV_SHARING_KWARG, None)
        share = _shared_kv(self, shared_states)
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            raise RuntimeError(
                "activation (gradient) checkpointing is on for a ds_longseq streambp model: StreamBP already keeps "
                "only each layer's input, so checkpointing would only recompute twice. Call "
                f"{CHECKPOINTING_OFF_CALL}."
            )
        _check_chunkable_kwargs(self.name, layer, kwargs)
        _check_position_embeddings(self.name, layer, position_embeddings, T)
        _check_padding_mask(self.name, layer, attention_mask)
        doc_start = _documents(outer_spec, packed, position_ids, attention_mask, B, T)
        _check_mixer(self, doc_start, sp)
        check_zero3_leaf(layer)
        with_router_logits = self.parts.router_tap is not None and router_logits_requested()
        if with_router_logits and sp is not None:
            raise NotImplementedError(
                "output_router_logits (the mixture-of-experts load-balancing loss) under sequence parallelism: each "
                "rank routes only its shard, so the loss would need the group's routing statistics. Pass "
                "output_router_logits=False (or set config.output_router_logits=False), or disable sequence_parallel"
            )
        if not self.token_wise_checked and layer.training and torch.is_grad_enabled():
            self.token_wise_checked = True
            _check_token_wise(self, tokens, attention_mask, position_ids, position_embeddings, mixer_masks, kwargs)
        # taken after the checks above (the token-wise one runs the layer): the forward's draws, which every pass of a
        # chunk replays (the capture, the backward's re-forward, the K/V gradient pass, the probes)
        draws = replay_draws(layer, hidden_states.device)
        call = _LayerCall(tokens, sp, doc_start, attention_mask, position_ids, position_embeddings, mixer_masks,
                          shared_states, share, None if share is None else self.parts.kv_sharing[0], with_router_logits,
                          kwargs, draws)
        return call

    def _run_chunk(self, call: "_LayerCall", x_c: torch.Tensor, s: int, e: int, stream):
        """The stock layer on tokens [s, e) of the packed layer input (StreamBP's ``run_chunk``): (B, C, d_out),
        or with router logits recorded (out_c, (B, C, E))."""
        h_c, per_token = call.tokens.split(x_c)
        if call.share is not None:
            stream.produces, stream.reads = (call.share, None) if call.role == "store" else (None, call.share)
        if call.shared_states is not None:
            per_token = {**per_token, KV_SHARING_KWARG: _SharedKVView(self.name, self.parts.kv_sharing, stream)}
        h_c = h_c.contiguous()  # a slice of a batch > 1 is not; some layers .view() their input

        def run():
            stream.begin_chunk()
            spec = AttnSpec(stream, self.attention, call.sp, call.doc_start)
            # each pass of this chunk starts its draws from the chunk's own generator state (ops.draws)
            region = call.draws.region(s) if call.draws is not None else nullcontext()
            with chunk_spec(spec), self.unread.skipping(stream), region:
                out = self.orig_forward(
                    h_c,
                    attention_mask=_chunk_mask(self.parts.mixer, call, s, e),
                    position_ids=None if call.position_ids is None else call.position_ids[..., s:e],
                    **{self.cache_kwarg: layer_cache(stream)},
                    use_cache=False,
                    position_embeddings=_chunk_of(call.position_embeddings, s, e),
                    **{SPEC_KWARG: spec},
                    **per_token,
                    **{key: None if m is None else m[:, s:e] for key, m in call.mixer_masks.items()},
                    **call.kwargs,
                )
            _check_chunk_attended(self.name, self.layer, stream, s, e, token_wise=self.parts.mixer == "token_wise")
            if isinstance(out, tuple):
                call.returned = _check_extra_outputs(self.name, self.layer, out)
                out = out[0]
            else:
                call.returned = 0
            return call.tokens.pack_output(out)

        state = getattr(stream, "state", None)
        if not self.state_checked and state is not None and state.mode == "forward" and state.index == 1:
            self.state_checked = True
            _check_carried_states_used(self.name, self.layer, stream.state, run, x_c.device)
        if call.with_router_logits:  # (out_c, router logits (B, C, E)): an auxiliary output of the Function
            return self.parts.router_tap.call_recording(run, call.tokens.batch_shape[0], e - s)
        return run()

    def _stream(self, call: "_LayerCall"):
        """The layer through StreamBP's Function for its kind (attention, head-sharded or state-passing mixer)."""
        run_chunk = functools.partial(self._run_chunk, call)
        offloader = None if self.offload is None else self.offload.offloader()
        # StreamBP's Function keeps the layer input itself (saved, or offloaded to the host): run_chunk, which the
        # Function keeps for the backward, must not hold it too through `tokens`, or it stays on the device.
        layer_input = call.tokens.take_packed()
        params = list(self.layer.parameters())
        sp = call.sp
        recurrent = self.parts.mixer in ("recurrent", "both")
        keep = self.parts.mixer is None and self.keep is not None and bool(self.keep.chosen)
        # The router runs once per chunk (and again in backward): not what transformers should record.
        with collection_paused() if self.parts.router_tap is not None else nullcontext():
            sharded = getattr(self.parts.mixer_module, "forward", None)
            if sp is not None and self.parts.mixer is None:
                return streambp_sp_apply(run_chunk, layer_input, params, self.chunk_size, sp.kv_exchange,
                                         offloader, keep_attention_output=keep)
            if sp is not None and self.parts.mixer == "recurrent" and isinstance(sharded, HeadShardedMixerForward):
                # the mixer runs once per layer over the whole sequence, sharded by heads across the group
                return streambp_mixer_sp_apply(run_chunk, layer_input, params, self.chunk_size,
                                               lambda x: sharded.sharded(x, sp.key_valid), offloader)
            if sp is not None and self.parts.mixer == "both" and isinstance(sharded, HeadShardedMixerForward):
                # the same mixer call, and the attention beside it exchanging its keys/values once per pass
                return streambp_mixer_sp_apply(run_chunk, layer_input, params, self.chunk_size,
                                               lambda x: sharded.sharded(x, sp.key_valid), offloader, sp.kv_exchange)
            # a recurrent layer under sequence parallelism continues from the previous rank's state
            return streambp_apply(run_chunk, layer_input, params, self.chunk_size, offloader,
                                  min_chunk=2 if recurrent else 1,
                                  ring=sp.state_ring if sp is not None and recurrent else None,
                                  keep_attention_output=keep)

def _documents(outer_spec, packed: dict, position_ids, attention_mask, B: int, T: int):
    """(B, T) start of each token's packed document, or None (one document per row; under sequence
    parallelism the attention reads the global starts from ``AttnSpec.sp``)."""
    if outer_spec is not None and outer_spec.sp is not None:
        if any(v is not None for v in packed.values()):
            raise ValueError(
                "cu_seq_lens_q/k under sequence parallelism: pass packed rows as restarting position_ids "
                "instead (ds_longseq.engine.shard_batch carries them, with each document's global boundaries)"
            )
        return None
    if outer_spec is not None:  # found once for the whole forward by CausalLMForward
        return outer_spec.doc_start
    # a caller that bypasses CausalLMForward (model.model(...) directly): found per layer
    return find_documents(position_ids, attention_mask, B, T, packed.get("cu_seq_lens_q"),
                          packed.get("cu_seq_lens_k"))[0]


def _check_mixer(forward: StreamBPLayerForward, doc_start, sp) -> None:
    """Refuse packed documents on a recurrent mixer, and an attention + recurrent layer under SP unless its mixer
    is sharded by heads."""
    layer = forward.layer
    if forward.parts.mixer in ("recurrent", "both") and (doc_start is not None or (sp is not None
                                                                          and sp.doc_start is not None)):
        raise NotImplementedError(
            f"StreamBP: {forward.name} ({type(layer).__name__}) carries a recurrent state (a linear-attention, "
            "state-space or short-convolution mixer), which transformers' torch path does not reset at packed "
            "documents' starts (it would carry one document's state into the next): send one document per row"
        )
    sharded = isinstance(getattr(forward.parts.mixer_module, "forward", None), HeadShardedMixerForward)
    if forward.parts.mixer == "both" and sp is not None and not sharded:
        raise NotImplementedError(
            f"StreamBP: {forward.name} ({type(layer).__name__}) runs an attention and a recurrent mixer side by "
            "side, which ds_longseq runs under sequence parallelism with the mixer sharded by heads only (passing "
            "its state rank to rank would serialise the ranks inside the attention's exchange of keys): set "
            "long_seq.sequence_parallel.recurrent='heads'"
        )


def _check_token_wise(forward: StreamBPLayerForward, tokens: "_TokenInputs", attention_mask, position_ids,
                      position_embeddings, mixer_masks: dict, kwargs: dict) -> None:
    """The first training forward of a layer with no token mixer: its stock forward on the first tokens
    mixes none of them (``check_token_wise``); it is then safe to run chunk by chunk with nothing carried."""
    n = min(tokens.batch_shape[1], TOKEN_WISE_PROBE_TOKENS)

    def run(x: torch.Tensor) -> torch.Tensor:
        h, per_token = tokens.split(x)
        out = forward.orig_forward(
            h.contiguous(),
            attention_mask=None if attention_mask is None else attention_mask[:, :n],
            position_ids=None if position_ids is None else position_ids[..., :n],
            use_cache=False,
            position_embeddings=_chunk_of(position_embeddings, 0, n),
            **per_token,
            **{key: None if m is None else m[:, :n] for key, m in mixer_masks.items()},
            **kwargs,
        )
        return tokens.pack_output(out[0] if isinstance(out, tuple) else out)

    with collection_paused() if forward.parts.router_tap is not None else nullcontext():
        check_token_wise(f"{forward.name} ({type(forward.layer).__name__}, a layer with no token mixer)", run,
                         tokens.packed, "long_seq.streambp")


def _shared_kv(forward: StreamBPLayerForward, shared_states) -> SharedKV | None:
    """This forward's :class:`SharedKV` for this layer's key: new for a "store" layer, the one an earlier
    layer of the same forward stored for a "reuse" layer; None for a layer that shares nothing. Kept on
    the model's per-forward ``shared_kv_states`` object, so each forward has its own."""
    if forward.parts.kv_sharing is None:
        return None
    role, key, _ = forward.parts.kv_sharing
    if shared_states is None or not hasattr(shared_states, "__dict__"):
        raise NotImplementedError(
            f"StreamBP: {forward.name} ({type(forward.layer).__name__}) shares keys/values across layers but gets "
            f"{KV_SHARING_KWARG}={type(shared_states).__name__}, not the model's per-forward KVSharingDict: this "
            "model cannot run under long_seq.streambp when called so; use mini_seq"
        )
    registry = vars(shared_states).setdefault("_ds_longseq_shared_kv", {})
    if role == "store":
        registry[key] = SharedKV(f"the {key!r} keys/values {forward.name} stores")
    elif key not in registry:
        raise NotImplementedError(
            f"StreamBP: {forward.name} ({type(forward.layer).__name__}) attends the {key!r} keys/values of an earlier "
            "layer, but no layer of this forward stored them (passed in from outside the forward): this model "
            "cannot run under long_seq.streambp; use mini_seq"
        )
    return registry[key]


def _chunk_mask(mixer: str | None, call: "_LayerCall", s: int, e: int):
    """The padding mask a chunk [s, e) is called with: a recurrent or token-wise mixer's own tokens'; an
    attention's keys [0, e) (under sequence parallelism None: the attention takes the GLOBAL mask from
    ``sp``)."""
    mask = call.attention_mask
    if mask is None:
        return None
    if mixer in ("recurrent", "token_wise"):
        return mask[:, s:e]
    return None if call.sp is not None else mask[:, :e]


@dataclasses.dataclass
class _LayerCall:
    """One training forward of a StreamBP layer: what its chunks are cut from and what they share."""

    tokens: "_TokenInputs"
    sp: object  # the forward's SequenceParallel state (AttnSpec.sp), or None
    doc_start: torch.Tensor | None  # (B, T) packed documents' starts, or None
    attention_mask: torch.Tensor | None  # (B, T) padding mask
    position_ids: torch.Tensor | None
    position_embeddings: object  # (cos, sin) (..., T, D), one such tensor, or None
    mixer_masks: dict  # a recurrent mixer's own masks (RECURRENT_MASK_KWARGS), cut per chunk
    shared_states: object  # the model's per-forward shared_kv_states, or None
    share: SharedKV | None  # this layer's SharedKV (cross-layer K/V sharing), or None
    role: str | None  # "store" | "reuse" | None
    with_router_logits: bool
    kwargs: dict  # the stock layer's other arguments, passed to every chunk unchanged
    draws: object  # the forward's ops.draws.Draws, each chunk's pass run in its region; None outside training
    returned: int = 0  # how many things the stock layer returns: 0 for its hidden states alone, else a tuple's


def _check_padding_mask(name: str, layer: torch.nn.Module, attention_mask) -> None:
    """Raise unless ``attention_mask`` is None or a 2D (batch, seq) padding mask StreamBP can cut into chunks."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"StreamBP: {name} ({type(layer).__name__}) gets attention_mask as a "
            f"{type(attention_mask).__name__}, not a 2D (batch, seq) padding mask StreamBP can cut into chunks: "
            "this model cannot run under long_seq.streambp; use mini_seq"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"streambp layers take a 2D (batch, seq) padding mask, got shape {tuple(attention_mask.shape)}"
        )


class _SharedKVView:
    """What a StreamBP layer's chunk gets as ``shared_kv_states`` (``KV_SHARING_KWARG``): a "reuse" layer's read
    of its key is served by the stream (``KVStream.read_shared``: the producer's keys/values of tokens [0, end),
    with their gradient sent back to it), a "store" layer's write of its chunk is dropped (its whole-sequence
    buffers are stored after the forward); any other access raises, naming the layer."""

    def __init__(self, name: str, kv_sharing: tuple[str, str, bool] | None, stream):
        self.name, self.kv_sharing, self.stream = name, kv_sharing, stream

    def _unexpected(self, what: str, key) -> NotImplementedError:
        return NotImplementedError(
            f"StreamBP: {self.name} {what} shared keys/values {key!r}, which its attention module does not mark "
            f"(store_full_length_kv / is_kv_shared_layer): this model cannot run under long_seq.streambp; use mini_seq"
        )

    def __getitem__(self, key):
        if self.kv_sharing is not None and self.kv_sharing[:2] == ("reuse", key):
            return self.stream.read_shared()
        raise self._unexpected("reads", key)

    def __setitem__(self, key, value) -> None:
        if self.kv_sharing is None or self.kv_sharing[:2] != ("store", key):
            raise self._unexpected("writes", key)


class _TokenInputs:
    """A layer's input as one (B, T, d_in) tensor StreamBP cuts on dim 1, and back.

    - Stacked hidden states (S, B, T, d) (Gemma 3n's AltUp streams, ``streams`` = S) ride as (B, T, S*d), and the
      layer's (S, B, C, d) chunk outputs likewise (:meth:`pack_output`, :meth:`unpack_output`).
    - Per-token inputs besides the hidden states (``families.PER_TOKEN_LAYER_INPUTS``, e.g. Gemma 4's
      ``per_layer_input``), taken out of ``kwargs``, ride on the last dim after them.

    :attr:`packed` is (B, T, S*d + sum of the inputs' trailing sizes), so the chunks, the saved (or offloaded)
    layer input and the exact input gradient (split back by autograd) cover everything with no second input to
    the StreamBP function. :meth:`split` gives a chunk's hidden states and keyword arguments back."""

    def __init__(self, name: str, layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict,
                 streams: int | None = None):
        self.streams = streams
        if streams is None and hidden.dim() != 3 or streams is not None and (
            hidden.dim() != 4 or hidden.shape[0] != streams
        ):
            wanted = "(B, T, d)" if streams is None else f"(S={streams}, B, T, d)"
            raise NotImplementedError(
                f"StreamBP: {name} ({type(layer).__name__}) takes hidden states of shape {tuple(hidden.shape)}, not "
                f"{wanted}: StreamBP cannot find their token dim to cut into chunks: this model cannot run under "
                "long_seq.streambp; use mini_seq"
            )
        if streams is not None:  # (S, B, T, d) -> (B, T, S*d): streams of one token side by side
            hidden = hidden.permute(1, 2, 0, 3).flatten(2)
        self.batch_shape = tuple(hidden.shape[:2])
        found = {key: kwargs.pop(key) for key in sorted(PER_TOKEN_LAYER_INPUTS) if kwargs.get(key) is not None}
        for key, value in found.items():
            if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == hidden.shape[:2]
                    and value.dtype == hidden.dtype):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise NotImplementedError(
                    f"StreamBP: {name} ({type(layer).__name__}) gets {key} of {got}"
                    f"{f' {value.dtype}' if isinstance(value, torch.Tensor) else ''}, not a (B, T, ...) = "
                    f"{tuple(hidden.shape[:2])} tensor in {hidden.dtype} StreamBP can cut into chunks: this model "
                    "cannot run under long_seq.streambp; use mini_seq"
                )
        self.width = hidden.shape[-1]
        self.parts = [(key, value.shape[2:], value[0, 0].numel()) for key, value in found.items()]
        self.packed = hidden if not found else torch.cat(
            [hidden, *(value.flatten(2) for value in found.values())], dim=-1
        )

    def take_packed(self) -> torch.Tensor:
        """:attr:`packed`, handed over: this object keeps no reference to it afterwards (it lives on in closures
        StreamBP keeps for the backward, which would otherwise keep every layer's input on the device)."""
        packed, self.packed = self.packed, None
        return packed

    def split(self, x_c: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A chunk of :attr:`packed`, (B, C, d_in), as the hidden states ((B, C, d), or (S, B, C, d) stacked) and
        the per-token kwargs."""
        h_c = x_c[..., : self.width] if self.parts else x_c
        if self.streams is not None:
            h_c = h_c.unflatten(-1, (self.streams, -1)).permute(2, 0, 1, 3)
        out, start = {}, self.width
        for key, shape, size in self.parts:
            out[key] = x_c[..., start:start + size].unflatten(-1, shape) if shape else x_c[..., start]
            start += size
        return h_c, out

    def pack_output(self, out_c: torch.Tensor) -> torch.Tensor:
        """A chunk's layer output as StreamBP assembles it, (B, C, d_out): stacked (S, B, C, d) -> (B, C, S*d)."""
        if self.streams is None:
            return out_c
        if out_c.dim() != 4 or out_c.shape[0] != self.streams:
            raise NotImplementedError(
                f"StreamBP: a layer taking {self.streams} stacked hidden-state streams returned shape "
                f"{tuple(out_c.shape)}, not (S={self.streams}, B, C, d): this model cannot run under "
                "long_seq.streambp; use mini_seq"
            )
        return out_c.permute(1, 2, 0, 3).flatten(2)

    def unpack_output(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's (B, T, d_out) output in the layout the model passes on: (S, B, T, d) when stacked."""
        return out if self.streams is None else out.unflatten(-1, (self.streams, -1)).permute(2, 0, 1, 3)


def _chunk_of(position_embeddings, s: int, e: int):
    """Tokens [s, e) of a layer's position embeddings: a (cos, sin) pair of (..., T, D) tensors, one such
    tensor (complex rotary frequencies), or None (a family without rotary embeddings)."""
    if position_embeddings is None:
        return None
    if isinstance(position_embeddings, torch.Tensor):
        return position_embeddings[..., s:e, :]
    return tuple(t[..., s:e, :] for t in position_embeddings)


def _check_position_embeddings(name: str, layer: torch.nn.Module, position_embeddings, T: int) -> None:
    """Raise unless the position embeddings have the sequence on dim -2, where :func:`_chunk_of` cuts them."""
    if position_embeddings is None:
        return
    parts = [position_embeddings] if isinstance(position_embeddings, torch.Tensor) else list(position_embeddings)
    if not parts or any(not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] != T for t in parts):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in parts]
        raise NotImplementedError(
            f"StreamBP: {name} ({type(layer).__name__}) gets position_embeddings of shapes {shapes}, not (..., T={T}, "
            "D) tensors StreamBP can cut into chunks: this model cannot run under long_seq.streambp; use mini_seq"
        )


_CHUNKED_KWARGS = "attention_mask, position_ids, position_embeddings (a (cos, sin) pair) and packed-document lengths"


def _check_chunkable_kwargs(name: str, layer: torch.nn.Module, kwargs: dict) -> None:
    """Raise if the layer gets a tensor argument StreamBP does not cut per chunk (it would see the whole
    sequence's, or fail on a shape): per-layer inputs, a bias, a prepared mask of another form."""
    tensors = sorted(
        key for key, value in kwargs.items()
        if isinstance(value, torch.Tensor)
        or (isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))
    )
    if tensors:
        raise NotImplementedError(
            f"StreamBP: {name} ({type(layer).__name__}) is called with {tensors}, which StreamBP does not cut into "
            f"chunks (it cuts {_CHUNKED_KWARGS}): this model cannot run under long_seq.streambp; use mini_seq"
        )


def _check_extra_outputs(name: str, layer: torch.nn.Module, out: tuple) -> int:
    """``len(out)`` of a layer returning a tuple, whose elements after the hidden states must all be None (attention
    weights and caches, off in training): anything else would be one chunk's, which StreamBP does not assemble."""
    extra = [type(x).__name__ for x in out[1:] if x is not None]
    if extra:
        raise NotImplementedError(
            f"StreamBP: {name} ({type(layer).__name__}) returns {extra} beside its hidden states, which StreamBP "
            "does not assemble from its chunks (output_attentions off?): this model cannot run under "
            "long_seq.streambp; use mini_seq"
        )
    return len(out)


def _check_carried_states_used(name: str, layer: torch.nn.Module, state, call: Callable,
                               device: torch.device) -> None:
    """Raise unless the layer's output on the current (second) chunk changes with each state it starts from.

    A mixer may read a state and still compute its multi-token path without it (Jamba's Mamba scan takes the
    recurrent state only in its one-token decode step): run chunk by chunk it would silently restart. So the
    chunk is run once per incoming state with that state perturbed (:meth:`CarriedState.perturbed`), then once
    as is (what it writes then is what the forward keeps); an output equal to the unperturbed one is refused.
    Once per layer, on its first forward of two chunks or more."""
    probes = {}
    with generators_kept(device):  # the probes' draws must not shift the forward's
        for key in sorted(state.incoming):
            with state.perturbed(key):
                probes[key] = call()
    reference = call()
    main = (lambda out: out[0] if isinstance(out, tuple) else out)
    ignored = [key for key, out in probes.items() if torch.equal(main(out), main(reference))]
    if ignored:
        raise NotImplementedError(
            f"StreamBP: {name} ({type(layer).__name__}) reads its carried state(s) {ignored} but computes the same "
            "output from other values of it (its multi-token path restarts from zeros, e.g. Jamba's Mamba scan): "
            "run in chunks it would not continue from the tokens before, so long_seq.streambp cannot run this model "
            "exactly; use mini_seq"
        )


def _check_chunk_attended(name: str, layer: torch.nn.Module, stream, s: int, e: int, token_wise: bool = False) -> None:
    """The runtime guard: one cache update and one call of ds_longseq's chunk attention with this chunk's
    queries and keys, else the layer mixes tokens some other way and would see only its chunk. A recurrent
    mixer must instead read the states the previous chunk wrote and write them again (``CarriedState.problem``);
    a layer that only does that has no attention to check. A layer with no token mixer (``token_wise``) must
    do none of it (else discovery missed its mixer)."""
    state = getattr(stream, "state", None)
    if isinstance(stream, (MixerStream, MixedStream)):  # a head-sharded mixer (ops.head_sharding) served this chunk
        if stream.calls != 1:
            raise NotImplementedError(
                f"StreamBP: {name} ({type(layer).__name__}) called its head-sharded mixer {stream.calls} times on "
                f"tokens [{s}, {e}) (once expected): long_seq.streambp cannot run this model exactly under "
                "sequence parallelism; set long_seq.sequence_parallel.recurrent='pass_state'"
            )
        if isinstance(stream, MixerStream):
            return
        # a MixedStream: the attention beside the mixer is checked as any attention's below
    if token_wise:
        if stream.updates or stream.attended or state is not None and state.used:
            raise NotImplementedError(
                f"StreamBP: {name} ({type(layer).__name__}) was found to have no token mixer but used its KV cache "
                f"on tokens [{s}, {e}): ds_longseq cannot tell how it mixes tokens, so long_seq.streambp cannot run "
                "this model exactly; use mini_seq"
            )
        return
    if state is not None and state.used:
        problem = state.problem()
        if problem is not None:
            raise NotImplementedError(
                f"StreamBP: {name} ({type(layer).__name__}) {problem} on tokens [{s}, {e}): run in chunks it would "
                "not continue from the tokens before, so long_seq.streambp cannot run this model exactly; use mini_seq"
            )
        if stream.updates == 0 and not stream.attended:
            return
    C = e - s
    keys = stream.attended_keys()  # whole-cache mode (KVStream): the prefix too
    if stream.updates == 1 and stream.attended == [(C, keys)]:
        return
    if stream.updates != 1:
        what = f"wrote its keys/values through its KV cache's update() {stream.updates} times (once expected)"
    elif not stream.attended:
        what = ("never called the attention function transformers' attention interface selects (it computes "
                "attention inline, or mixes tokens with another module)")
    else:
        what = (f"called the attention function with (queries, keys) = {stream.attended}, expected [({C}, {keys})] "
                "with the keys and values it wrote through the cache")
    raise NotImplementedError(
        f"StreamBP: {name} ({type(layer).__name__}) {what} on tokens [{s}, {e}): run in chunks it would see only its "
        "own chunk, so long_seq.streambp cannot run this model exactly; use mini_seq"
    )
