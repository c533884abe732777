"""Long-sequence techniques, one module each, declared as data and installed by ``ds_longseq.patch.enable``.

Each module holds one :class:`~ds_longseq.techniques.base.Technique` subclass: its ``long_seq`` section,
what it must run after, what it conflicts with or needs, what it checks on a model and what it installs.
Importing this package registers them; the order they install in comes from their ``run_after``
declarations alone (ties: registration order, which is alphabetical here and never relied on):

    approx_bp          Approx-BP activations and memory-sharing norms
    sequence_parallel  DeepSpeed-Ulysses sequence parallelism
    offload            layer inputs in host memory
    streambp           StreamBP over whole decoder layers
    mini_seq           MsT mini-sequence MLP
    lm_head            chunked LM head and loss
    adjoint            adjoint sharding of residual SSM stacks

A technique of your own: subclass ``Technique`` in one module, give it a ``Config`` dataclass, decorate it
with :func:`register` (see tests/test_techniques.py for a complete one).
"""

from ds_longseq.techniques.adjoint import Adjoint
from ds_longseq.techniques.approx_bp import ApproxBP
from ds_longseq.techniques.base import (
    EnableContext,
    PatchHandle,
    Technique,
    active_techniques,
    forward_only_config,
    register,
    unregister,
)
from ds_longseq.techniques.lm_head import LMHead
from ds_longseq.techniques.mini_seq import MiniSeq
from ds_longseq.techniques.offload import Offload
from ds_longseq.techniques.sequence_parallel import SequenceParallelism, sequence_parallel_layout
from ds_longseq.techniques.streambp import StreamBP

__all__ = [
    "Technique",
    "register",
    "unregister",
    "active_techniques",
    "forward_only_config",
    "EnableContext",
    "PatchHandle",
    "ApproxBP",
    "SequenceParallelism",
    "sequence_parallel_layout",
    "Offload",
    "StreamBP",
    "MiniSeq",
    "LMHead",
    "Adjoint",
]
