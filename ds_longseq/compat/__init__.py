"""The one package that touches third parties' private names: DeepSpeed's, transformers', torch's, the Trainer
family's (transformers' Trainer, TRL, accelerate) and bitsandbytes', one module per library.

Modules:
    versions: TESTED_VERSIONS, the lowest and highest release of each dependency the suite runs on; every
        difference between the two ends is in the modules below, named by the release it covers.
    transformers_shims: activation checkpointing under either name, ``_attn_implementation``, the output collector,
        Gemma 4's K/V-shared slicing, the KV cache keyword, packed chunk counting, keys left out on save.
    torch_shims: a module's parameters read as other tensors, a modeling module's function stood in for, a
        tensor's version counter, matrix products left uncomputed below autograd, torch.distributed's default
        group and store.
    deepspeed_shims: DeepSpeed's sequence-parallel group and all-to-all, ZeRO-3's leaf flag and partition mark,
        ``deepspeed.initialize`` stood in for, checkpoint parallel dimensions, ZeRO-1/2 flat buffers detached.
    deepspeed_repairs: ZeRO-3's gradient average under sequence parallelism (keyed on checked releases) and what
        the universal-checkpoint load leaves wrong.
    trainer_shims: the Hugging Face Trainer's, TRL's and accelerate's internals.
    weight_formats: GGUF-loaded models made plain, bitsandbytes' 4-bit linears kept off their CPU repacking.
    touches: TOUCHES_ELSEWHERE, the few touches of third-party internals or objects that must sit outside this
        package, each with its reason (tests/test_compat.py fails on any other).

Every name here is private to its library and may move in any release; ``setup.py``'s ranges are the versions the
test suite ran with (docs/VERSIONS.md). Callers import from ``ds_longseq.compat``; the names below are its public
API, each defined in the module above that covers its library.

Not here, each listed in ``TOUCHES_ELSEWHERE`` with its reason: ``torch.ops.aten._*`` attention kernels in
``ops/tile_kernels.py``'s kernel table (torch's operator registry, each kernel tested against the math path on every
device that runs it), the per-instance patch of ``techniques/base.py``, and a few documented hooks.
"""

from __future__ import annotations

from ds_longseq.compat import (
    deepspeed_repairs,
    deepspeed_shims,
    torch_shims,
    touches,
    trainer_shims,
    transformers_shims,
    versions,
    weight_formats,
)
from ds_longseq.compat.deepspeed_repairs import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.deepspeed_shims import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.torch_shims import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.touches import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.trainer_shims import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.transformers_shims import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.versions import *  # noqa: F403 - the names its __all__ lists
from ds_longseq.compat.weight_formats import *  # noqa: F403 - the names its __all__ lists

# every public name of the modules above, each listed once, in its own module's __all__
__all__ = [
    *versions.__all__,
    *transformers_shims.__all__,
    *torch_shims.__all__,
    *deepspeed_shims.__all__,
    *deepspeed_repairs.__all__,
    *trainer_shims.__all__,
    *weight_formats.__all__,
    *touches.__all__,
]
