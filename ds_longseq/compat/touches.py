"""The touches of third-party internals, or assignments to third-party objects, that must sit outside the compat
package, each with its reason.

Holds:
    TOUCHES_ELSEWHERE: ``file:function:name`` -> why; tests/test_compat.py reads the package's code and fails on any
        other touch, and on any entry no longer found.
"""

from __future__ import annotations

__all__ = [
    "TOUCHES_ELSEWHERE",
]


TOUCHES_ELSEWHERE: dict[str, str] = {
    # "<file under ds_longseq/>:<Class.method or function>:<name>": why it is not behind a function here
    "lazy.py:lazy_exports.__getattr__:setattr": "caches a lazily imported name on ds_longseq's own package module "
    "(ds_longseq, ds_longseq.ops, ds_longseq.families), as the import system does for a submodule; no third-party "
    "object",
    **{f"ops/tile_kernels.py:{kernel}.{direction}:{op}": "torch's operator registry (the schema-versioned "
       "entry points scaled_dot_product_attention dispatches to), one kernel table, each kernel tested against the "
       "math path"
       for kernel, ops in {
           "_CpuFlash": ("_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention_for_cpu_backward"),
           "_CudaFlash": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
           "_CudaCudnn": ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
           "_CudaEfficient": ("_efficient_attention_forward", "_efficient_attention_backward"),
       }.items() for direction, op in zip(("forward", "backward"), ops, strict=True)},
    **{f"techniques/base.py:PatchHandle.set_instance_attr{where}:object.{method}":
       "THE per-instance patch: every technique's change to a model goes through it, recorded and undone by "
       "disable() (object.__setattr__: an nn.Module's own __setattr__ would register a submodule)"
       for where, method in (("", "__setattr__"), (".restore", "__setattr__"), (".restore", "__delattr__"))},
    "forwards/head_sharding_forward.py:_attributes:setattr":
        "a recurrent mixer's head counts narrowed to this rank's heads for one call, restored on exit (the mixer "
        "reads them inside its forward; which attributes: families/mixer_heads.py)",
    **{f"processes/watchdog.py:PeerWatch.{method}:sys.excepthook":
       "the watchdog names the rank that died: Python's documented hook, chained to and restored on stop"
       for method in ("start", "stop")},
    "processes/mpi_env.py:main:sys.argv": "python -m ds_longseq.processes.mpi_env runs the user's script as __main__",
    "engine/initialize.py:initialize_with:args.deepspeed_config":
        "DeepSpeed reads the config path from the user's argparse namespace: emptied after the long_seq "
        "section was taken out (deepspeed.initialize's documented args= protocol)",
    "trainer/mixin.py:LongSeqTrainerMixin._prepare_inputs:_prepare_inputs":
        "TRL's GRPO generates inside this Trainer hook: under sequence parallelism generation runs paused (each "
        "rank its own prompts, whole); no public hook runs there",
}
"""Touches of third-party internals, or assignments to third-party objects, outside the compat package, keyed
``file:function:name``; tests/test_compat.py fails on any touch not here, and on any entry no longer found."""
