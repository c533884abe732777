"""What a technique is, how techniques are registered, ordered and installed, and the record that undoes them.

Holds:
    Technique: the base class. A technique declares, as data, its ``long_seq`` section (``name``,
        ``Config``), what it must run after (``run_after``), what it cannot be combined with
        (``conflicts_with``) and which others it needs (``needs_one_of``); as methods, what it checks
        on a model (``check``), what it installs (``install``) and which modules ZeRO-3 must treat as
        leaves (``zero3_leaves``).
    register / unregister: add a technique class to the registry (its section joins ``LongSeqConfig``).
    active_techniques: the active techniques of a config, in their declared order.
    forward_only_config: a config's techniques that also serve a forward-only model beside the trained one.
    EnableContext: what one ``enable()`` call shares between the techniques it installs.
    PatchHandle: the record of what was changed on one model, in order, with its undo.

Adding a technique is one module: a ``Technique`` subclass with its ``Config`` dataclass, registered
with :func:`register`. ``ds_longseq.patch.enable`` is the loop over :func:`active_techniques`.
Conflicts and needs are checked when the config is parsed (``LongSeqConfig.from_dict``), before any
model is touched; ``run_after`` orders installation, ties in registration order.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import torch

from ds_longseq import config as _config
from ds_longseq.compat import (
    KV_SHARED_SLICING,
    check_output_capturing,
    get_attn_implementation,
    set_attn_implementation,
    unsliced_kv_shared_inputs,
)
from ds_longseq.config import LongSeqConfig, LongSeqConfigError
from ds_longseq.families import DecoderLMAdapter
from ds_longseq.forwards.attention_interface import (
    ATTN_IMPLEMENTATION,
    CHUNK_ATTR,
    WINDOW_ATTR,
    longseq_attention,
    longseq_mask,
)
from ds_longseq.forwards.moe import RouterTap

if TYPE_CHECKING:
    from ds_longseq.forwards.causal_lm import CausalLMForward
    from ds_longseq.forwards.layer_input_offload import LayerInputOffload
    from ds_longseq.forwards.sp_model import SequenceParallel
    from ds_longseq.ops.sp_layout import SPLayout

__all__ = [
    "Technique", "register", "unregister", "active_techniques", "forward_only_config", "EnableContext", "PatchHandle",
]

_MISSING = object()


class PatchHandle:
    """What ``enable`` changed on one model; :meth:`undo` restores it exactly, last change first."""

    def __init__(self, model: torch.nn.Module, config: LongSeqConfig):
        self.model = model
        self.config = config
        self._undo: list[Callable[[], None]] = []
        self.sp: SequenceParallel | None = None  # the model's sequence-parallel group, when enabled with one
        self.forward: CausalLMForward | None = None  # the model forward installed, when one is
        self.techniques: list[Technique] = []  # the techniques installed, in order
        self.context: EnableContext | None = None  # what they shared while installing (zero3_leaves reads it)

    def set_instance_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` on this instance (shadowing a class attribute or method), undoably."""
        previous = obj.__dict__.get(name, _MISSING)
        object.__setattr__(obj, name, value)

        def restore():
            if previous is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, previous)

        self._undo.append(restore)

    def add_hook(self, hook_handle) -> None:
        """Record a ``torch.utils.hooks.RemovableHandle`` to remove on undo."""
        self._undo.append(hook_handle.remove)

    def add_undo(self, fn: Callable[[], None]) -> None:
        """Record a call to make on undo (after everything recorded later is undone)."""
        self._undo.append(fn)

    def set_attn_implementation(self, hf_config: Any, name: str) -> None:
        """Select attention implementation ``name`` on ``hf_config``, undoably."""
        previous = get_attn_implementation(hf_config)
        set_attn_implementation(hf_config, name)
        self._undo.append(lambda: set_attn_implementation(hf_config, previous))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


class EnableContext:
    """What one ``enable()`` shares between the techniques it installs.

    Attributes:
        model: the ``*ForCausalLM`` being patched (inside a PEFT wrapper: the inner model).
        config: the parsed ``long_seq`` section.
        handle: the undo record (left on the model by the driver).
        sp_group: the process group passed to ``enable`` for sequence parallelism, or None.
        sp_layout: the sequence-parallel layout passed to ``enable`` (``ops.sp_layout.SPLayout``), or None (then
            ``sequence_parallel`` builds one on ``sp_group``).
        adapter: where a decoder model's parts are (None for an SSM model).
        sp: the model's sequence-parallel group object, once ``sequence_parallel`` installed it.
        offload: the layer-input offload, once ``offload`` installed it.
    """

    def __init__(self, model: torch.nn.Module, config: LongSeqConfig, handle: PatchHandle, *,
                 sp_group=None, sp_layout: SPLayout | None = None, adapter: DecoderLMAdapter | None = None):
        self.model = model
        self.config = config
        self.handle = handle
        self.sp_group = sp_group
        self.sp_layout = sp_layout
        self.adapter = adapter
        self.sp: SequenceParallel | None = None
        self.offload: LayerInputOffload | None = None
        self._router_taps: dict[torch.nn.Module, RouterTap] | None = None
        self._attention_registered = False

    def router_taps(self) -> dict[torch.nn.Module, RouterTap]:
        """A ``RouterTap`` per mixture-of-experts layer (hooked on its router once): chunked layers
        return their router logits whole through it. Empty for a dense model."""
        if self._router_taps is None:
            self._router_taps = {}
            for layer in self.adapter.layers:
                router = self.adapter.router(layer)
                if router is not None:
                    check_output_capturing()  # the recording the taps hand the logits to
                    self._router_taps[layer] = tap = RouterTap()
                    self.handle.add_hook(router.register_forward_hook(tap))
        return self._router_taps

    def use_longseq_attention(self) -> None:
        """Route the model's attention through ds_longseq's function (``ATTN_IMPLEMENTATION``).

        Registers that NEW name with transformers' ``AttentionInterface`` / ``AttentionMaskInterface``
        (existing names such as "sdpa" are never overwritten, so other models in the process are
        unaffected) and selects it on this model's config. Idempotent within one ``enable``.
        """
        if self._attention_registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, longseq_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, longseq_mask)
        self.handle.set_attn_implementation(self.model.config, ATTN_IMPLEMENTATION)
        self._attention_registered = True
        # families whose attention keeps its sliding window in the mask only: the window goes on the module
        # for ds_longseq's attention to read (attention.WINDOW_ATTR); the mask audit checks it per forward
        for layer, window in self.adapter.mask_only_windows():
            self.handle.set_instance_attr(self.adapter.attention(layer), WINDOW_ATTR, window)
        # masks stay 2D with ds_longseq's attention: Gemma 4's inference shortcut would index them as 4D
        decoder = self.adapter.base_model
        if callable(getattr(decoder, KV_SHARED_SLICING, None)):
            self.handle.set_instance_attr(decoder, KV_SHARED_SLICING, unsliced_kv_shared_inputs)
        # chunked attention (Llama 4) lives in the mask only too (attention.CHUNK_ATTR; audited the same way)
        for layer, chunk in self.adapter.attention_chunks():
            self.handle.set_instance_attr(self.adapter.attention(layer), CHUNK_ATTR, chunk)


class Technique:
    """One long-sequence technique, declared as data (section, order, conflicts, needs) plus three methods.

    Subclasses set the class attributes and override what applies; register them with :func:`register`.
    An instance is made per ``enable()`` call; keep per-model state on the ``EnableContext`` or the handle.
    """

    name: ClassVar[str]
    """The technique's ``long_seq`` section (``long_seq.<name>``)."""
    Config: ClassVar[type]
    """The section's dataclass: one docstring per field, ``enabled: bool`` unless :meth:`active` says otherwise."""
    run_after: ClassVar[tuple[str, ...]] = ()
    """Techniques installed before this one when both are active (e.g. a layer forward that reads the offload)."""
    conflicts_with: ClassVar[Mapping[str, str]] = {}
    """Technique name -> why the two cannot be combined and what to do: refused when the config is parsed."""
    needs_one_of: ClassVar[tuple[str, ...]] = ()
    """At least one of these must be active too (refused when the config is parsed otherwise)."""
    needs_reason: ClassVar[str] = ""
    """Why, and what to do, for ``needs_one_of``."""
    model_kind: ClassVar[str] = "decoder"
    """The models it runs on: "decoder" (a known decoder family, ``ds_longseq.families``) or "ssm" (a
    residual state-space stack, ``families.ssm``)."""
    uses_model_forward: ClassVar[bool] = False
    """Whether it needs ds_longseq's causal-LM forward on the model (``forwards.causal_lm``); the driver
    installs that forward once, after every technique, when any active one says so."""
    needs_process_group: ClassVar[bool] = False
    """Whether ``engine.initialize`` must start torch.distributed before ``enable`` (it reads the world)."""
    forward_only: ClassVar[bool] = False
    """Whether it is also installed on a model that only runs forwards without gradient beside the trained one
    (TRL DPO's reference model: :func:`forward_only_config`), which must cut and score sequences as the trained
    model does; the training techniques (StreamBP, offload, ...) would have nothing to do there."""

    @classmethod
    def section(cls, config: LongSeqConfig) -> Any:
        """This technique's section of ``config``."""
        return config.section(cls.name)

    @classmethod
    def active(cls, config: LongSeqConfig) -> bool:
        """Whether ``config`` switches the technique on (default: ``enabled is True``)."""
        return getattr(cls.section(config), "enabled", False) is True

    @classmethod
    def describe(cls, config: LongSeqConfig) -> str:
        """How messages name the technique as configured (default ``long_seq.<name>``)."""
        return f"long_seq.{cls.name}"

    def check(self, ctx: EnableContext) -> list[str]:
        """Why this technique cannot run ``ctx.model`` exactly (empty when it can). Nothing is changed yet."""
        return []

    def install(self, ctx: EnableContext) -> None:
        """Apply the technique to ``ctx.model``, recording every change on ``ctx.handle``."""

    def zero3_leaves(self, ctx: EnableContext) -> list[torch.nn.Module]:
        """Modules whose chunk loops need their weights gathered once by ZeRO-3 (marked as leaf modules)."""
        return []

    def engine_problems(self, config: LongSeqConfig, zero_stage: int) -> list[str]:
        """Why this technique cannot run under DeepSpeed with ``zero_stage`` (checked with the config)."""
        return []


def register(technique: type[Technique]) -> type[Technique]:
    """Add ``technique`` to the registry (usable as a class decorator); its section joins ``LongSeqConfig``."""
    if not (isinstance(technique, type) and issubclass(technique, Technique)):
        raise TypeError(f"register takes a Technique subclass, got {technique!r}")
    if not isinstance(getattr(technique, "name", None), str):
        raise TypeError(f"{technique.__name__} must set name = '<its long_seq section>'")
    if technique.model_kind not in ("decoder", "ssm"):
        raise ValueError(f"{technique.__name__}.model_kind must be 'decoder' or 'ssm', got {technique.model_kind!r}")
    _config.register_technique(technique)
    return technique


def unregister(technique: type[Technique] | str) -> None:
    """Remove a registered technique (and a section it added)."""
    _config.unregister_technique(technique if isinstance(technique, str) else technique.name)


def forward_only_config(config: LongSeqConfig) -> LongSeqConfig:
    """``config`` for a model that only runs forwards without gradient beside the trained one (TRL DPO's reference):
    the sections of the techniques that declare ``forward_only`` (sequence parallelism, the chunked head) and the
    sections no technique owns (``attention``, ``watchdog``), copied; every other technique off."""
    registered = _config.registered_techniques()
    kept = {f.name: dataclasses.replace(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name != "extra" and (f.name not in registered or registered[f.name].forward_only)}
    return dataclasses.replace(LongSeqConfig(), **kept)


def active_techniques(config: LongSeqConfig) -> list[Technique]:
    """Instances of the techniques ``config`` switches on, each after every active one in its ``run_after``
    (ties in registration order).

    Raises:
        LongSeqConfigError: a ``run_after`` names an unregistered technique, or the declarations form a circle.
    """
    registered = _config.registered_techniques()
    problems = [
        f"technique {name!r} declares run_after {after!r}, which is not a registered technique"
        for name, t in registered.items()
        for after in t.run_after
        if after not in registered
    ]
    if problems:
        raise LongSeqConfigError(problems)
    pending = [name for name, t in registered.items() if t.active(config)]
    ordered: list[str] = []
    while pending:
        ready = next((n for n in pending if all(a not in pending for a in registered[n].run_after)), None)
        if ready is None:
            raise LongSeqConfigError([f"the run_after declarations of {pending} form a circle"])
        ordered.append(ready)
        pending.remove(ready)
    return [registered[name]() for name in ordered]
