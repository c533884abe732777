"""DeepSpeed-Ulysses sequence parallelism (MsT paper Sec. 3.3 / App. E) as a technique: ``long_seq.sequence_parallel``.

Holds:
    SequenceParallelism: builds the model's ``forwards.sp_model.SequenceParallel`` over the
        process group, routes attention through ds_longseq's function (heads exchanged for tokens) and
        installs the decoder stack's forward pre-hook that passes each forward's shard context.
    sequence_parallel_group: the group ``enable`` uses: the one given, else DeepSpeed's.
"""

from __future__ import annotations

import torch

from ds_longseq.compat import deepspeed_sp_group, zero3_sequence_parallel_problem
from ds_longseq.config import LongSeqConfig, SequenceParallelConfig
from ds_longseq.families.mixer_heads import head_layout
from ds_longseq.forwards.attn_spec import AttentionSettings
from ds_longseq.forwards.sharded_mixer import HeadShardedMixerForward
from ds_longseq.forwards.sp_model import (
    SequenceParallel,
    SequenceParallelForwardHook,
    ShardOffsetHook,
    register_layout,
)
from ds_longseq.ops.sp_layout import sp_degrees
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["SequenceParallelism", "sequence_parallel_group"]


def sequence_parallel_group(config: LongSeqConfig, group=None):
    """The process group for ``config.sequence_parallel``: ``group``, else DeepSpeed's initialised one."""
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
    if dist.get_world_size(group) != size:
        raise ValueError(
            f"long_seq.sequence_parallel.size={size} but the sequence-parallel group has "
            f"{dist.get_world_size(group)} ranks: make them equal"
        )
    return group


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
        problems: list[str] = []
        recurrent = [i for i, layer in enumerate(ctx.adapter.layers) if ctx.adapter.mixer(layer) is not None]
        size = ctx.config.sequence_parallel.size
        ring_problems = self._ring_problems(ctx, recurrent)
        if ring_problems:  # None: no ring; []: a ring this model can run
            return ring_problems
        if recurrent and ctx.config.sequence_parallel.recurrent == "heads":
            reasons = {layout for i in recurrent
                       if isinstance(layout := head_layout(ctx.adapter.mixer(ctx.adapter.layers[i]), 0, size), str)}
            problems += [
                f"long_seq.sequence_parallel.recurrent='heads' on {spec.causal_lm_class}: layers {recurrent} carry a "
                f"recurrent state and cannot be sharded by heads ({reason}); set recurrent='pass_state' (with "
                "long_seq.streambp), or long_seq.sequence_parallel.size=1"
                for reason in sorted(reasons)
            ]
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
        """(Ulysses degree, ring degree) of this model under the config (``ops.sp_layout.sp_degrees``)."""
        text = ctx.model.config.get_text_config()
        section = ctx.config.sequence_parallel
        kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return sp_degrees(section.size, text.num_attention_heads, section.ring, kv)

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
        sp = SequenceParallel(
            sequence_parallel_group(ctx.config, ctx.sp_group),
            text.num_attention_heads,
            getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            ring=self.degrees(ctx)[1],
        )
        ctx.handle.add_undo(register_layout(sp.size, sp.ring))  # shard_batch cuts by it when not told
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

