"""DeepSpeed-Ulysses sequence parallelism (MsT paper Sec. 3.3 / App. E) as a technique: ``long_seq.sequence_parallel``.

Holds:
    SequenceParallelism: builds the model's ``forwards.sp_model.SequenceParallel`` over the
        process group, routes attention through ds_longseq's function (heads exchanged for tokens) and
        installs the decoder stack's forward pre-hook that passes each forward's shard context.
    sequence_parallel_layout: the layout ``enable`` gives a model (``ops.sp_layout.SPLayout``: its Ulysses x ring
        degrees from the heads, its groups made on the group given, else DeepSpeed's), for a caller that builds it
        once and hands it to ``enable(..., sp_layout=)`` (several models on the same groups).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ds_longseq.compat import deepspeed_sp_group, zero3_sequence_parallel_problem
from ds_longseq.config import LongSeqConfig, SequenceParallelConfig
from ds_longseq.families.decoder import softcap_under_sdpa_problem
from ds_longseq.families.discovery import mixer_gets_layer_kwargs
from ds_longseq.families.mixer_heads import head_layout
from ds_longseq.forwards.attn_spec import AttentionSettings
from ds_longseq.forwards.head_sharding_forward import HeadShardedMixerForward
from ds_longseq.forwards.sp_model import SequenceParallel, SequenceParallelForwardHook, ShardOffsetHook
from ds_longseq.ops.sp_layout import SPLayout, sp_degrees
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["SequenceParallelism", "sequence_parallel_layout"]


def sequence_parallel_layout(model: torch.nn.Module, config: Mapping[str, Any] | LongSeqConfig, group=None
                             ) -> SPLayout:
    """The layout ``enable`` gives ``model`` under ``config.sequence_parallel``: Ulysses x ring degrees from the
    model's heads (``ops.sp_layout.sp_degrees``; the section's ``ring`` forced when set), the groups made on
    ``group``, else DeepSpeed's initialised one (:meth:`~ds_longseq.ops.sp_layout.SPLayout.build`, collective: every
    rank calls it). Build it once to run several models on the same groups: ``enable(model, config,
    sp_layout=layout)``.

    Raises:
        RuntimeError: no group given and DeepSpeed's groups are not built.
        ValueError: the section's ring does not fit the heads; the group does not have ``size`` ranks, or under a
            ring is not DeepSpeed's (consecutive ranks).
    """
    config = LongSeqConfig.of(config)
    section = config.sequence_parallel
    _, ring = _model_degrees(model, section.size, section.ring)
    return SPLayout.build(_process_group(config, group), section.size, ring)


def _process_group(config: LongSeqConfig, group=None):
    """The process group for ``config.sequence_parallel``: ``group``, else DeepSpeed's initialised one (its ranks
    checked against the size where the layout is built: ``SPLayout.build``)."""
    import torch.distributed as dist

    size = config.sequence_parallel.size
    if group is None:
        group = deepspeed_sp_group()
    if group is None or not dist.is_initialized():
        raise RuntimeError(
            f"long_seq.sequence_parallel.size={size} needs a process group of {size} ranks: create the engine with "
            "ds_longseq.engine.initialize(...), or pass enable(model, config, sp_group=<group>) after "
            "torch.distributed.init_process_group"
        )
    return group


def _model_degrees(model: torch.nn.Module, size: int, ring: int | None) -> tuple[int, int]:
    """(u, r) for ``model``'s query and key/value heads at SP ``size`` (``ring`` forced when given)."""
    text = model.config.get_text_config()
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return sp_degrees(size, text.num_attention_heads, ring, kv)


@register
class SequenceParallelism(Technique):
    """``size`` ranks share each sequence; attention exchanges heads for tokens (all-to-all)."""

    name = "sequence_parallel"
    Config = SequenceParallelConfig
    run_after = ("approx_bp",)
    uses_model_forward = True  # shift_labels checks and the group's token-weighted loss
    needs_process_group = True
    forward_only = True  # a DPO reference model's calls are cut and scored as the policy's

    @classmethod
    def active(cls, config: LongSeqConfig) -> bool:
        return config.sequence_parallel.enabled

    def check(self, ctx: EnableContext) -> list[str]:
        spec = ctx.adapter.spec
        if not spec.sequence_parallel_verified:
            # The shard context reaches the attention through the decoder's and layers' **kwargs, and no layer
            # may count positions from the shard's start; both are proven per family by a 2-rank parity test,
            # which most families found from their structure do not have yet.
            return [
                f"long_seq.sequence_parallel on {spec.causal_lm_class}: sequence parallelism is verified on the "
                "families written in ds_longseq.families.FAMILIES and the discovered ones marked in "
                "families.discovery.OVERRIDES, and this one was found from its structure without such a test "
                "(StreamBP, mini_seq and the chunked head apply); set long_seq.sequence_parallel.size=1"
            ]
        softcap = softcap_under_sdpa_problem(ctx.model)
        problems: list[str] = [] if softcap is None else [f"long_seq.sequence_parallel: {softcap}"]
        recurrent = [i for i, layer in enumerate(ctx.adapter.layers) if ctx.adapter.mixer(layer) is not None]
        size = ctx.config.sequence_parallel.size
        ring_problems = self._ring_problems(ctx, recurrent)
        if ring_problems:  # None: no ring; []: a ring this model can run
            return problems + ring_problems
        if recurrent and ctx.config.sequence_parallel.recurrent == "heads":
            reasons = {layout for i in recurrent
                       if isinstance(layout := head_layout(ctx.adapter.mixer(ctx.adapter.layers[i]), 0, size), str)}
            problems += [
                f"long_seq.sequence_parallel.recurrent='heads' on {spec.causal_lm_class}: layers {recurrent} carry a "
                f"recurrent state and cannot be sharded by heads ({reason}); set recurrent='pass_state' (with "
                "long_seq.streambp), or long_seq.sequence_parallel.size=1"
                for reason in sorted(reasons)
            ]
            deaf = sorted({type(ctx.adapter.layers[i]).__name__ for i in recurrent
                           if not mixer_gets_layer_kwargs(type(ctx.adapter.layers[i]), spec.mixer_attr)})
            if not reasons and deaf:
                problems.append(
                    f"long_seq.sequence_parallel.recurrent='heads' on {spec.causal_lm_class}: {', '.join(deaf)}"
                    f".forward calls its {spec.mixer_attr} without passing on its keyword arguments (transformers "
                    "5.16's layers), so the shard context never reaches the mixer and each rank would run it on its "
                    "own tokens alone; pip install 'transformers>=5.24', set recurrent='pass_state' (with "
                    "long_seq.streambp; not for a layer with an attention beside its mixer), or "
                    "long_seq.sequence_parallel.size=1"
                )
        elif recurrent and not ctx.config.streambp.enabled:
            problems.append(
                f"long_seq.sequence_parallel.recurrent='pass_state' on {spec.causal_lm_class} without "
                f"long_seq.streambp: layers {recurrent} carry a recurrent state (linear attention, state space, short "
                "convolution), which each rank's shard must continue from the previous rank's; ds_longseq passes "
                "it rank to rank inside StreamBP only. Enable long_seq.streambp, set recurrent='heads', or set "
                "long_seq.sequence_parallel.size=1"
            )
        both = [i for i in recurrent if ctx.adapter.attention(ctx.adapter.layers[i]) is not None]
        if both and ctx.config.sequence_parallel.recurrent == "pass_state":
            problems.append(
                f"long_seq.sequence_parallel.recurrent='pass_state' on {spec.causal_lm_class}: layers {both} run an "
                "attention beside their recurrent mixer, whose keys every rank exchanges at once, so the ranks cannot "
                "take turns passing the mixer's state inside the layer; set recurrent='heads' (the default)"
            )
        return problems + [
            f"long_seq.sequence_parallel with rope_type={kind!r}: this RoPE scaling picks its frequencies from the "
            "largest position the forward sees, and under sequence parallelism each rank sees only its shard (the "
            "ranks would rotate with other frequencies than one process on the whole sequence); use a static "
            "scaling (linear, yarn, llama3) or set long_seq.sequence_parallel.size=1"
            for kind in ctx.adapter.length_dependent_rope()
        ]

    @staticmethod
    def degrees(ctx: EnableContext) -> tuple[int, int]:
        """(Ulysses degree, ring degree) of this model under the config (``ops.sp_layout.sp_degrees``), or of the
        layout handed to ``enable`` (checked against the config and the heads).

        Raises:
            ValueError: a ring the heads do not fit; a handed layout without groups, or of another size or ring
                than the section's.
        """
        section, given = ctx.config.sequence_parallel, ctx.sp_layout
        if given is None:
            return _model_degrees(ctx.model, section.size, section.ring)
        if given.group is None:
            raise ValueError("enable(sp_layout=) needs a layout with its process groups (SPLayout.build, "
                             "techniques.sequence_parallel_layout), not one only to cut batches by")
        if given.size != section.size or section.ring not in (None, given.ring):
            raise ValueError(
                f"enable(sp_layout=) runs {given.ulysses} x {given.ring} (Ulysses x ring) on {given.size} ranks, but "
                f"long_seq.sequence_parallel is size={section.size}, ring={section.ring}: pass the layout built for "
                "this section (techniques.sequence_parallel_layout), or make them agree"
            )
        return _model_degrees(ctx.model, given.size, given.ring)

    def _ring_problems(self, ctx: EnableContext, recurrent: list[int]) -> list[str] | None:
        """Why this model cannot run its ring yet (a list, maybe empty, when it needs one); None without a ring."""
        try:
            ulysses, ring = self.degrees(ctx)
        except ValueError as err:
            return [str(err)]
        if ring == 1:
            return None
        heads = ctx.model.config.get_text_config().num_attention_heads
        why = (f"long_seq.sequence_parallel.size={ulysses * ring} on {heads} attention heads runs Ulysses x ring "
               f"{ulysses} x {ring}")
        problems = []
        if ctx.adapter.cache_positioned_attention():
            problems.append(f"{why}, and this family positions its queries by the cache's length (a contiguous "
                            f"shard's offset): use a size that divides {heads}")
        return problems

    def engine_problems(self, config: LongSeqConfig, zero_stage: int) -> list[str]:
        problem = zero3_sequence_parallel_problem() if zero_stage == 3 else None
        return [] if problem is None else [problem]

    def install(self, ctx: EnableContext) -> None:
        text = ctx.model.config.get_text_config()
        layout = ctx.sp_layout  # built once where its groups are made, kept by the model (shard_batch reads it)
        if layout is None:
            layout = SPLayout.build(_process_group(ctx.config, ctx.sp_group), ctx.config.sequence_parallel.size,
                                    self.degrees(ctx)[1])
        sp = SequenceParallel(
            layout, text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        )
        ctx.use_longseq_attention()
        hook = SequenceParallelForwardHook(sp, AttentionSettings.from_config(ctx.config.attention))
        ctx.handle.add_hook(ctx.adapter.base_model.register_forward_pre_hook(hook, with_kwargs=True))
        ctx.handle.add_hook(ctx.adapter.base_model.register_forward_hook(hook.end, with_kwargs=True, always_call=True))
        # queries positioned by the cache's length get the shard's global offset from a stand-in cache
        for attn in ctx.adapter.cache_positioned_attention():
            ctx.handle.add_hook(attn.register_forward_pre_hook(ShardOffsetHook(sp), with_kwargs=True))
        ctx.sp = ctx.handle.sp = sp
        if ctx.config.sequence_parallel.recurrent == "heads":
            for i, layer in enumerate(ctx.adapter.layers):
                mixer = ctx.adapter.mixer(layer)
                if mixer is not None:
                    name = f"{ctx.adapter.where}[{i}].{ctx.adapter.spec.mixer_attr}"
                    ctx.handle.set_instance_attr(mixer, "forward", HeadShardedMixerForward(
                        mixer, mixer.forward, sp.token_exchange, name, None if sp.ring == 1 else sp.degrees))

    def zero3_leaves(self, ctx: EnableContext) -> list[torch.nn.Module]:
        # a head-sharded mixer slices its parameters itself: ZeRO-3 must gather them whole first
        if ctx.config.sequence_parallel.recurrent != "heads":
            return []
        return [m for m in map(ctx.adapter.mixer, ctx.adapter.layers) if m is not None]

