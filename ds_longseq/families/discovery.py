"""Decoder families found from a model's structure, for the ``model_type``s no spec in ``decoder.FAMILIES`` names.

Holds:
    discover_spec: a ``FamilySpec`` read from a ``*ForCausalLM`` instance (where its decoder stack,
        layers, attention modules, MLPs, routers, final norm and LM head are; which config fields are
        dropout, router noise or a final-logit softcap), or the reasons it cannot be run.
    head_kind: what the class's own ``forward`` computes after the decoder stack (one of
        :data:`HEAD_TEMPLATES`), recognised by comparing its code with the families ds_longseq
        implements; None for anything else (a different loss, an unknown logit transform).
    logit_scale: the factor the "logit_scale" / "logits_scaling" heads put on the logits.
    HEAD_TEMPLATES: the representative classes of each head kind.

Why by code and not by name: ds_longseq replaces the ``*ForCausalLM`` forward (the chunked LM head computes
the loss itself), so whatever that forward does to the logits must be done again. A family whose forward is
not, statement for statement, one of the known ones (say a new ``logits * multiplier``) is refused instead of
silently trained without it. The comparison is on the syntax tree, so formatting, comments, docstrings,
type annotations and the output class's name do not matter, and a transformers release that changes the
code makes a family refused, never wrong.

The attention inside each layer is checked the same way (its ``forward`` must select transformers'
attention interface and write K/V through the KV cache's ``update``), and at run time by the StreamBP
layer forward (every chunk must reach ds_longseq's attention with its own keys and the prefix).

What it relies on in transformers' code, and what a release changing it does. Everything is read from the
installed transformers, so a change made to every family alike (Llama's code and the copies of it) is
followed; a change to some families only, or to one of these names, is not:

- the class: one in the model's MRO named ``*ForCausalLM`` or listed in
  ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (that module moved, discovery
  raises ``ImportError`` on every family it is asked about);
- the decoder stack at ``model.<base_model_prefix>`` (else ``model.model``) or its one child holding the layers
  (OPT's ``model.decoder``), with exactly one ``nn.ModuleList`` of ``config.get_text_config().num_hidden_layers``
  layers as a direct child: layers split over several lists or nested deeper, or the count under another
  config name, refuse the family ("has no ModuleList of config.num_hidden_layers=...");
- the LM head: ``get_output_embeddings()``, a direct child that is a plain ``nn.Linear``;
- the ``*ForCausalLM.forward`` source (``inspect.getsource``: the installed ``.py`` files), statement for
  statement equal after :class:`_Normalise` to the forward of a :data:`HEAD_TEMPLATES` class (looked up by
  name on ``transformers``): the decoder called as ``self.<prefix>(...)``, its output read as
  ``outputs.last_hidden_state`` or ``outputs[0]``, ``slice_logits_to_keep``, the loss from
  ``self.loss_function(...)``, a ``*OutputWithPast(...)`` returned. A new statement in one family's forward (a
  keyword handled, another loss or logit transform), another spelling of these, or a template class renamed
  or removed (``tests/test_discovery.py`` checks each is still found) refuses the family ("forward does
  something after its decoder stack ...");
- each layer's attention: the one child whose class name holds "Attention", its ``forward`` source containing
  the text ``ALL_ATTENTION_FUNCTIONS`` and ``.update(`` (the attention-interface registry and the KV cache's
  ``update``, whatever the cache argument is called: ``past_key_values`` before transformers 5.24, ``cache``
  since). A renamed registry, or the cache write or interface call moved out of the attention's own
  ``forward`` (into the layer, a helper, a base class), refuses every family written so ("does not compute
  through transformers' attention interface"); an attention one module further down (BERT's layout) is
  refused as such;
- recurrent token mixers: a layer child whose ``forward`` source contains ``.update_recurrent_state(`` or
  ``.update_conv_state(`` (the linear-attention cache API). Renamed, a layer whose only token mixer it is
  looks mixer-free: refused at ``enable`` unless exactly one other child has parameters, else taken for a
  token-wise block and refused by the first forward's token-wise probe (``forwards.replay.check_token_wise``);
  one beside an attention (Falcon-H1's layout) is not refused here;
- module kinds by class or attribute name: norms (``nn.LayerNorm`` or a class name holding "Norm"), the MLP
  (the one other child with parameters, else the child named ``mlp``; none found, mini_seq refuses), a
  mixture of experts (a child with an ``experts`` attribute, its router the ``gate`` or ``router`` module), a
  learned key indexer (a class name holding "Indexer": ``attention_problem``). A mixture of experts no longer
  found is not refused here; only the sweep's exactness check on the MoE families would catch a wrong result;
- config fields by name: dropouts (holding "dropout" or "pdrop", kept where the layers' class sources name
  them; refused when nonzero under StreamBP) and router noise ("jitter", "noise"; refused when nonzero under
  StreamBP and mini_seq). A dropout under another word is not listed, leaving only the run-time checks (an
  active ``nn.Dropout`` in a StreamBP layer, a nonzero ``dropout=`` reaching ds_longseq's attention);
- :func:`masks_see_packed_rows`: the decoder calling transformers' ``create_*mask`` builders with
  ``position_ids``; not recognised, packed rows are refused without StreamBP (the safe side).
- :func:`mixer_gets_layer_kwargs`: a hybrid layer calling its recurrent mixer with the cache and ``**kwargs``;
  not recognised, sequence parallelism sharding the mixer by heads is refused (the safe side).

So a transformers release that breaks the parsing makes families refused with the reason, not trained wrong
(except where noted above). The sweep (``tests/test_model_sweep.py``) counts a refusal as a pass, so
``tests/discovery_records/`` records which families discovery recognised per transformers version, and
``tests/test_discovery.py`` fails naming each recorded family it no longer recognises, with this module's
reason (after upgrading transformers: ``python -m tests.discovery_record``, then ``--write``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import numbers
import textwrap

import torch

from ds_longseq.compat import CACHE_KWARGS

__all__ = [
    "discover_spec", "head_kind", "logit_scale", "is_plain_linear", "is_state_mixer", "masks_see_packed_rows",
    "mixer_gets_layer_kwargs",
    "HEAD_TEMPLATES", "MOE_AUX_KINDS", "OVERRIDES", "text_config",
]

def is_plain_linear(module: torch.nn.Module | None) -> bool:
    """A ``torch.nn.Linear`` computing ``x @ weight.T + bias`` and nothing else, which is what the chunked LM
    head re-implements. A subclass with its own forward or parameters (Dory's learned per-token logit scale)
    would have them silently skipped."""
    return (
        isinstance(module, torch.nn.Linear)
        and type(module).forward is torch.nn.Linear.forward
        and {name for name, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}
        and next(module.children(), None) is None
    )


HEAD_TEMPLATES: dict[str, tuple[str, ...]] = {
    # logits = lm_head(hidden); loss = the causal-LM cross entropy (dense families; MoE ones without a
    # load-balancing term, DeepSeek-V3's layout; GPT-J's slices the decoder's output in one statement)
    "plain": ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "GPTJForCausalLM"),
    # the same, with cap * tanh(logits / cap) after the head (Gemma 2's layout)
    "final_softcap": ("Gemma2ForCausalLM",),
    # the same, plus router_aux_loss_coef x the modeling module's load_balancing_loss_func on the recorded
    # router logits when output_router_logits (Mixtral's layout)
    "moe_aux": ("MixtralForCausalLM",),
    # logits = lm_head(hidden) * model.logit_scale (Cohere's layout)
    "logit_scale": ("CohereForCausalLM",),
    # logits = lm_head(hidden) / config.logits_scaling (Granite's layout)
    "logits_scaling": ("GraniteForCausalLM",),
    # logits = lm_head(hidden) * config.logits_scaling (HyperCLOVA X's layout)
    "logits_multiplier": ("HyperCLOVAXForCausalLM",),
    # logits = lm_head(hidden) * model.model.lm_head_multiplier (Falcon-H1's layout)
    "lm_head_multiplier": ("FalconH1ForCausalLM",),
    # the plain head plus z_loss_coefficient x mean(logsumexp(logits)^2) over every position (Bamba's layout):
    # run as plain where the coefficient is 0 (its default), refused otherwise
    "z_loss": ("BambaForCausalLM",),
    # Mixtral's load-balancing loss on Granite's scaled logits (Granite-MoE's layout)
    "moe_aux_logits_scaling": ("GraniteMoeForCausalLM",),
    # logits = lm_head(hidden / config.logits_scaling) (MiniCPM3's layout): with no head bias, the same as
    # dividing the logits, which is how the chunked head applies it
    "hidden_scaling": ("MiniCPM3ForCausalLM",),
}
"""Head kind -> classes whose ``forward`` defines it (the transformers classes ds_longseq's forward re-implements)."""

_ATTENTION_MARKERS = ("ALL_ATTENTION_FUNCTIONS", ".update(")
_STATE_MARKERS = (".update_recurrent_state(", ".update_conv_state(")

OVERRIDES: dict[str, dict] = {
    # its Mamba mixer reads the carried state but scans from zeros (only its 1-token step uses the state):
    # tests/test_hybrids.py::test_jamba_scan_continued_across_chunks
    "jamba": {"mixer_scan_function": "mamba_selective_scan"},
    # the attention never passes its window on (it is in the mask only); the sliding layers' attention
    # modules hold it (full layers have no such attribute)
    "qwen2_moe": {"window_from": "module"},
    # every layer slides by config.sliding_window, applied by the mask only
    "phimoe": {"window_from": "config"},
    # sinks and sliding windows under Ulysses: test_feature_families.py::test_sequence_parallel_matches_one_process
    "gpt_oss": {"sequence_parallel_verified": True},
    # per-layer inputs, cross-layer K/V sharing (heads-sharded under StreamBP), sliding windows, per-layer head
    # dims under Ulysses: the same test
    "gemma4_text": {"sequence_parallel_verified": True},
    # chunked attention and temperature tuning's positions (the shard's offset) under Ulysses: the same test
    "llama4_text": {"sequence_parallel_verified": True},
    # multi-head latent attention (values of another head dim) under Ulysses: the same test; under StreamBP its
    # keys/values are taken at the attention call, expanded from the cached latent token by token
    "deepseek_v3": {"sequence_parallel_verified": True},
    # Gated DeltaNet layers under StreamBP pass their state rank to rank (ops.state_passing), gated attention
    # under Ulysses: tests/test_hybrids.py::test_sequence_parallel_matches_one_process (the text model; the
    # multimodal container's decoder is the same)
    "qwen3_5_text": {"sequence_parallel_verified": True},
    "qwen3_5": {"sequence_parallel_verified": True},
    # hybrids under Ulysses SP 2 and 4, each recurrent layer sharded by heads (Qwen3-Next's fused Gated DeltaNet,
    # OLMo-hybrid's, Kimi Linear's KDA, LFM2's and LFM2-MoE's short convolution by channels, Mamba-2 by whole
    # groups) or passing its state rank to rank under StreamBP (all of them):
    # tests/test_hybrids.py::test_hybrids_under_sequence_parallelism*
    **dict.fromkeys(("qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2", "lfm2_moe", "bamba", "nemotron_h",
                     "granitemoehybrid"), {"sequence_parallel_verified": True}),
    # attention and Mamba-2 side by side in each layer, the mixer sharded by heads (a rank's heads inside its one
    # group): tests/test_hybrids.py::test_falcon_h1_under_sequence_parallelism
    "falcon_h1": {"sequence_parallel_verified": True},
}
"""model_type -> ``FamilySpec`` fields that cannot be read from structure, for discovered families (each checked
by the sweep, tests/test_model_sweep.py, and per forward by the mask audit)."""
_DROPOUT_WORDS = ("dropout", "pdrop")
_NOISE_WORDS = ("jitter", "noise")
_ROUTER_ATTRS = ("gate", "router")


def text_config(model: torch.nn.Module):
    """The config describing the decoder stack (``get_text_config()`` for multimodal containers)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class _Normalise(ast.NodeTransformer):
    """Drop what does not change the loss a forward computes.

    Annotations, docstrings and output class names; how the decoder stack is called (its attribute name,
    argument order, the optional ``use_cache`` / ``output_router_logits`` arguments: ds_longseq calls it
    itself) and the resolution of ``output_router_logits`` (ds_longseq resolves it the same way); the
    argument spelling of ``self.loss_function`` (``vocab_size`` only reshapes); the name of the decoder's
    result (``transformer_outputs``) and ``outputs[0]`` for ``outputs.last_hidden_state``; ``.float()`` and
    ``.contiguous()`` on the logits (the loss is taken in float32 or better either way); a guard around
    ``slice_logits_to_keep`` (ds_longseq refuses ``logits_to_keep`` with labels); ``use_cache = False``
    under labels (ds_longseq's forward never keeps a cache when it computes the loss); every field of the
    returned output but ``loss``.
    """

    def __init__(self, decoder_attrs: tuple[str, ...], head_attr: str = "lm_head"):
        # how the forward may reach its decoder stack: ``self.<attr>`` for each (dotted for a nested one, OPT's
        # ``self.model.decoder``), all spelled ``self.model`` after normalising
        self.decoder_calls = {f"self.{attr}" for attr in decoder_attrs}
        self.head_attr = head_attr  # the LM head's attribute (BioGPT's output_projection), spelled lm_head
        self.renamed: dict[str, str] = {}

    def visit_AnnAssign(self, node):  # `outputs: BaseModelOutputWithPast = self.model(...)`
        if node.value is None:
            return None
        return self.visit(ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node))

    def visit_Assign(self, node):
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if targets == ["output_router_logits"]:
            return None
        if len(targets) == 1 and self._is_decoder_call(node.value):
            self.renamed[targets[0]] = "outputs"
        return self.generic_visit(node)

    def visit_If(self, node):
        body = node.body
        if (len(body) == 1 and isinstance(body[0], ast.Assign) and ast.unparse(body[0]) == "use_cache = False"
                and ast.unparse(node.test) == "labels is not None" and not node.orelse):
            return None
        if len(body) == 1 and not node.orelse and "slice_logits_to_keep" in ast.unparse(body[0]):
            return self.visit(body[0])
        return self.generic_visit(node)

    def visit_Name(self, node):
        if node.id.endswith("OutputWithPast"):
            return ast.copy_location(ast.Name(id="Output", ctx=node.ctx), node)
        if node.id in self.renamed:
            return ast.copy_location(ast.Name(id=self.renamed[node.id], ctx=node.ctx), node)
        return node

    def _is_decoder_call(self, value) -> bool:
        func = value.func if isinstance(value, ast.Call) else None
        return isinstance(func, ast.Attribute) and ast.unparse(func) in self.decoder_calls

    def visit_Attribute(self, node):  # self.<head attribute> -> self.lm_head
        if (self.head_attr != "lm_head" and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr == self.head_attr):
            return ast.copy_location(_self_attr("lm_head"), node)
        return self.generic_visit(node)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # a docstring or a bare string
        return self.generic_visit(node)

    def visit_Subscript(self, node):  # outputs[0] -> outputs.last_hidden_state
        node = self.generic_visit(node)
        if (isinstance(node.value, ast.Name) and node.value.id == "outputs" and isinstance(node.slice, ast.Constant)
                and node.slice.value == 0):
            return ast.copy_location(ast.Attribute(value=node.value, attr="last_hidden_state", ctx=ast.Load()), node)
        return node

    def visit_Call(self, node):
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("float", "contiguous") and not node.args
                and not node.keywords):
            return self.visit(func.value)  # x.float() / x.contiguous() -> x
        if self._is_decoder_call(node):
            return ast.copy_location(ast.Call(func=_self_attr("model"), args=[], keywords=[]), node)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            if func.attr == "loss_function":
                return ast.copy_location(ast.Call(func=_self_attr("loss_function"), args=[], keywords=[]), node)
        return self.generic_visit(node)

    def visit_Return(self, node):
        value = node.value
        if isinstance(value, ast.Call):
            loss = [k for k in value.keywords if k.arg == "loss"]
            value = ast.Call(func=ast.Name(id="Output", ctx=ast.Load()), args=[], keywords=loss)
            return ast.copy_location(ast.Return(value=self.visit(value)), node)
        return self.generic_visit(node)


def _self_attr(name: str) -> ast.Attribute:
    return ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=name, ctx=ast.Load())


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str | None:
    """The dedented source of ``cls.forward``, or None where it cannot be read."""
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None


def _forward_tree(cls: type) -> ast.Module | None:
    """``cls.forward`` parsed (a fresh tree each call: some readers transform it), or None where unreadable."""
    source = _forward_source(cls)
    try:
        return ast.parse(source) if source is not None else None
    except SyntaxError:
        return None


def _forward_code(cls: type, decoder_path: str | None = None, head_attr: str = "lm_head") -> str | None:
    """The normalised body of ``cls.forward`` (no signature, decorators or docstring), or None if unreadable.
    ``decoder_path``: where discovery found the decoder stack when it is not the base-model prefix itself
    (OPT's ``model.decoder``); ``head_attr``: the LM head's attribute name."""
    tree = _forward_tree(cls)
    func = tree.body[0] if tree is not None and tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    attrs = ("model", getattr(cls, "base_model_prefix", "model") or "model", *([decoder_path] if decoder_path else []))
    normalise = _Normalise(attrs, head_attr)
    body = [normalise.visit(stmt) for stmt in func.body]
    return "\n".join(ast.unparse(stmt) for stmt in body if stmt is not None)


@functools.lru_cache(maxsize=1)
def _template_codes() -> dict[str, str]:
    """Normalised forward code -> head kind, from the representatives this transformers ships."""
    import transformers

    codes: dict[str, str] = {}
    for kind, names in HEAD_TEMPLATES.items():
        for name in names:
            cls = getattr(transformers, name, None)
            code = None if cls is None else _forward_code(cls)
            if code is not None:
                codes.setdefault(code, kind)
    return codes


@functools.lru_cache(maxsize=None)
def _head_kind_of_class(cls: type, decoder_path: str | None, head_attr: str) -> str | None:
    code = _forward_code(cls, decoder_path, head_attr)
    return None if code is None else _template_codes().get(code)


MOE_AUX_KINDS = frozenset({"moe_aux", "moe_aux_logits_scaling"})
"""The head kinds that add Mixtral's load-balancing loss."""


def logit_scale(model: torch.nn.Module, kind: str) -> float:
    """The factor a head of ``kind`` multiplies the logits by right after the LM head (1.0 for most)."""
    if kind == "logit_scale":
        return float(model.logit_scale)
    if kind in ("logits_scaling", "moe_aux_logits_scaling", "hidden_scaling"):
        return 1.0 / float(text_config(model).logits_scaling)
    if kind == "logits_multiplier":
        return float(text_config(model).logits_scaling)
    if kind == "lm_head_multiplier":
        return float(model.model.lm_head_multiplier)
    return 1.0


def head_kind(model: torch.nn.Module, decoder_path: str | None = None, head_attr: str = "lm_head") -> str | None:
    """What ``type(model).forward`` computes after its decoder stack, one of :data:`HEAD_TEMPLATES`, or None.
    ``decoder_path`` (dotted) and ``head_attr``: where the decoder stack and the LM head are, when discovery found
    them elsewhere than ``model`` / ``lm_head``."""
    return _head_kind_of_class(type(model), decoder_path, head_attr)


def _is_mask_builder(name: str) -> bool:
    """transformers' builders of the decoder's own causal masks (``create_causal_mask``,
    ``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``, ...); not the encoder's bidirectional
    one a cross-attention decoder (GPT-2) builds besides."""
    return name.startswith("create_") and name.endswith("mask") and name != "create_bidirectional_mask"


@functools.lru_cache(maxsize=None)
def masks_see_packed_rows(decoder_cls: type) -> bool:
    """Whether a decoder stack's ``forward`` gives transformers' mask builders the position ids, which is how
    transformers finds packed rows (positions restarting, no ``attention_mask``, no cache) and keeps each document's
    attention to itself: every causal-mask builder call (``create_*mask``, called by name or through a variable
    bound to one, as Mistral's ``mask_function``) passes ``position_ids``, by keyword or in a dict literal
    unpacked into it (the ``mask_kwargs`` idiom, copies included). False for a forward building its masks without
    them (gpt-oss, OPT: their stock attention attends across packed documents), elsewhere, or unreadably."""
    tree = _forward_tree(decoder_cls)
    if tree is None:
        return False
    builders, with_positions = set(), set()  # names bound to a mask builder / to mask kwargs with position_ids
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        value = node.value
        if any(isinstance(n, ast.Name) and _is_mask_builder(n.id) for n in ast.walk(value)) and not isinstance(
            value, (ast.Call, ast.Dict)
        ):
            builders |= names  # mask_function = create_causal_mask if ... else create_sliding_window_causal_mask
        if isinstance(value, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "position_ids"
                                               for k in value.keys):
            with_positions |= names
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "copy"
                and isinstance(value.func.value, ast.Name) and value.func.value.id in with_positions):
            with_positions |= names  # sliding_mask_kwargs = mask_kwargs.copy()
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and (_is_mask_builder(node.func.id) or node.func.id in builders)
    ]

    def passes_positions(keyword: ast.keyword) -> bool:
        unpacked = keyword.value.id if keyword.arg is None and isinstance(keyword.value, ast.Name) else None
        return keyword.arg == "position_ids" or unpacked in with_positions

    return bool(calls) and all(any(passes_positions(k) for k in call.keywords) for call in calls)


@functools.lru_cache(maxsize=None)
def is_state_mixer(cls: type) -> bool:
    """Whether a module class's ``forward`` carries a recurrent or convolution state through transformers'
    linear-attention cache API (``update_recurrent_state`` / ``update_conv_state``): a linear-attention,
    state-space or short-convolution token mixer (Gated DeltaNet, Mamba, LFM2's short convolution)."""
    source = _forward_source(cls)
    return source is not None and any(marker in source for marker in _STATE_MARKERS)


_CACHE_WORDS = (*CACHE_KWARGS, "cache_params")  # a Mamba-style mixer's own name for the cache


@functools.lru_cache(maxsize=None)
def mixer_gets_layer_kwargs(layer_cls: type, mixer_attr: str) -> bool:
    """Whether a decoder layer class's ``forward`` hands its keyword arguments on (``**kwargs``) to its recurrent
    mixer ``self.<mixer_attr>``: every call of it that passes the cache (the recurrent branch: NemotronH's block
    calls its ``mixer`` in an attention and an MLP branch too) also passes ``**``. transformers 5.24's hybrid layers
    do; 5.16's Falcon-H1, LFM2, LFM2-MoE and NemotronH layers do not (what ds_longseq hands a layer then never
    reaches the mixer). False where no such call is found or the source is unreadable."""
    tree = _forward_tree(layer_cls)
    if tree is None:
        return False
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.dump(node.func) == ast.dump(_self_attr(mixer_attr))
        and any(k.arg in _CACHE_WORDS for k in node.keywords)
    ]
    return bool(calls) and all(any(k.arg is None for k in call.keywords) for call in calls)


@functools.lru_cache(maxsize=None)
def _routes_through_interface(cls: type) -> bool:
    """Whether an attention class's forward selects transformers' attention interface and updates the cache."""
    source = _forward_source(cls)
    return source is not None and all(marker in source for marker in _ATTENTION_MARKERS)


@functools.lru_cache(maxsize=1)
def _causal_lm_class_names() -> frozenset[str]:
    """The classes ``AutoModelForCausalLM`` builds (some older ones are named ``*LMHeadModel``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "Norm" in type(module).__name__


def _child_names(module: torch.nn.Module, keep) -> list[str]:
    return [name for name, child in module.named_children() if keep(child)]


def _fields(config, words: tuple[str, ...]) -> tuple[str, ...]:
    """Config fields whose name contains one of ``words`` and whose value is a number."""
    names = []
    for name, value in sorted(vars(config).items()):
        if any(word in name for word in words) and isinstance(value, numbers.Real) and not isinstance(value, bool):
            names.append(name)
    return tuple(names)


@functools.lru_cache(maxsize=None)
def _names_in_source(cls: type) -> frozenset[str]:
    """Every attribute name and string constant in the source of ``cls`` (empty where it has none)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        node.attr if isinstance(node, ast.Attribute) else node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) or (isinstance(node, ast.Constant) and isinstance(node.value, str))
    )


def _read_by_modules(modules: list[torch.nn.Module], fields: tuple[str, ...]) -> tuple[str, ...]:
    """The config ``fields`` that the code of the classes of ``modules`` and their submodules reads
    (``config.<field>``, ``getattr(config, "<field>")``). For the dropout fields StreamBP refuses, ``modules`` are
    the decoder layers, which it re-forwards in backward. A published checkpoint's config carries the fields of
    heads the causal LM never builds (GPT-2's ``summary_first_dropout`` for its double-heads model, GPT-NeoX's
    ``classifier_dropout`` for token classification), and of dropouts applied once before the layers (GPT-2's
    ``embd_pdrop``, which a re-forward from the saved layer input does not repeat): their classes read by no
    layer, those fields are left out. torch's own classes read no config."""
    names: set[str] = set()
    for cls in {type(m) for module in modules for m in module.modules()}:
        for klass in cls.__mro__:
            if not klass.__module__.startswith("torch") and klass is not object:
                names |= _names_in_source(klass)
    return tuple(f for f in fields if f in names)


def _is_causal_lm(cls: type) -> bool:
    """A ``*ForCausalLM`` class, or one ``AutoModelForCausalLM`` builds (some older ones are ``*LMHeadModel``)."""
    names = _causal_lm_class_names()
    return any(c.__name__.endswith("ForCausalLM") or c.__name__ in names for c in cls.__mro__)


def _find_decoder(model: torch.nn.Module, cls: str) -> tuple[str, torch.nn.Module, list[str], int | None] | str:
    """``(path, decoder stack, its layer-list attributes, config.num_hidden_layers)``, or the problem.

    The stack is ``model.<base_model_prefix>`` (``model`` where that is no module: Llama 4's text model names
    "language_model" but keeps its decoder at ``.model``), or its one child holding a layer list (OPT's
    ``model.decoder``); a layer list is a ``ModuleList`` of ``config.num_hidden_layers`` modules.
    """
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    if not isinstance(getattr(model, prefix, None), torch.nn.Module):
        prefix = "model"
    decoder = getattr(model, prefix, None)
    if not isinstance(decoder, torch.nn.Module):
        return f"{cls}.{prefix} (its base_model_prefix) is not the decoder stack"
    num_layers = getattr(text_config(model), "num_hidden_layers", None)

    def layer_lists(module: torch.nn.Module) -> list[str]:
        return _child_names(module, lambda c: isinstance(c, torch.nn.ModuleList) and len(c) == num_layers)

    lists = layer_lists(decoder)
    inner = [] if lists else [name for name, child in decoder.named_children() if layer_lists(child)]
    if len(inner) == 1:
        prefix, decoder = f"{prefix}.{inner[0]}", getattr(decoder, inner[0])
        lists = layer_lists(decoder)
    return prefix, decoder, lists, num_layers


def _unknown_head_problem(cls: str) -> str:
    return (
        f"{cls}.forward does something after its decoder stack that ds_longseq does not re-implement (its code "
        "is none of " + ", ".join(n for names in HEAD_TEMPLATES.values() for n in names) + "'s, e.g. a logit "
        "scale or another loss), and ds_longseq replaces that forward"
    )


def _parameterised(layer: torch.nn.Module, exclude: list[str]) -> tuple[str, ...]:
    """The children of ``layer`` with parameters, outside ``exclude`` and norms."""
    return tuple(name for name, child in layer.named_children()
                 if name not in exclude and not _is_norm(child) and any(True for _ in child.parameters()))


class _Mixers:
    """Each layer's token mixers (attention modules and recurrent state carriers) and what is left beside them."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.recurrent = [_child_names(layer, lambda c: is_state_mixer(type(c))) for layer in layers]
        self.attention = [
            _child_names(layer, lambda c: "Attention" in type(c).__name__ and not is_state_mixer(type(c)))
            for layer in layers
        ]
        # what is left beside each layer's token mixer: its MLP (or MoE block, or parts of one)
        self.others = [_parameterised(layer, self.attention[i] + self.recurrent[i]) for i, layer in enumerate(layers)]
        # layers with no token mixer at all (NemotronH's MLP and MoE blocks): one parameterised child, checked to
        # be token-wise on the first forward (forwards.replay.check_token_wise)
        self.token_wise = [i for i, names in enumerate(self.attention) if not names and not self.recurrent[i]]
        self.attn_attrs = {names[0] for names in self.attention if names}
        self.mixer_attrs = {names[0] for names in self.recurrent if names}
        self.attn_attr = next(iter(self.attn_attrs), None)
        self.mixer_attr = next(iter(self.mixer_attrs), None)

    def problem(self, layers: list[torch.nn.Module], where: str) -> str | None:
        """Why the layers' token mixers cannot be told apart, or None."""
        missing = [i for i in self.token_wise if len(self.others[i]) != 1]
        if missing:
            kinds = sorted({type(layers[i]).__name__ for i in missing})
            return (
                f"{where}{missing} ({', '.join(kinds)}) have no attention module, no token mixer carrying its state "
                "through transformers' linear-attention cache API (update_recurrent_state / update_conv_state) and "
                "not one MLP-like child either: ds_longseq cannot tell how they mix tokens"
            )
        several = [i for i, names in enumerate(self.attention) if len(names) > 1] + [
            i for i, names in enumerate(self.recurrent) if len(names) > 1]
        if several or len(self.attn_attrs) > 1 or len(self.mixer_attrs) > 1:
            return (
                f"{where}: the layers' token mixers are not one attribute per kind (attention "
                f"{sorted(map(tuple, self.attention))}, recurrent {sorted(map(tuple, self.recurrent))})"
            )
        return None


def _attention_problems(layers: list[torch.nn.Module], mixers: _Mixers, where: str) -> tuple[str | None, list[str]]:
    """``(attention_problem, problems)``: what keeps ds_longseq's own attention (StreamBP, SP) off the family (a
    learned key indexer), and what refuses it (attention computed outside transformers' interface or nested)."""
    attn_attr = mixers.attn_attr
    attentions = [getattr(layer, attn_attr) for layer, names in zip(layers, mixers.attention, strict=True) if names]
    inline = sorted({type(a).__name__ for a in attentions if not _routes_through_interface(type(a))})
    indexed = sorted({type(m).__name__ for a in attentions for m in a.modules() if "Indexer" in type(m).__name__})
    attention_problem = None
    if indexed:
        attention_problem = (
            f"{where}[i].{attn_attr} selects its keys with a learned indexer ({', '.join(indexed)}: sparse "
            "attention, DSA), which ds_longseq's chunked attention does not implement"
        )
    # the attention a level further down (BERT's self-attention inside its attention block; Zamba / Zamba2's
    # shared transformer block, one instance called from several hybrid layers)
    wrapped = {type(a).__name__: type(m).__name__ for a in attentions if type(a).__name__ in inline
               for m in a.modules() if m is not a and "Attention" in type(m).__name__}
    if wrapped:
        shared = len({id(a) for a in attentions}) < len(attentions)
        return attention_problem, [
            f"{where}[i].{attn_attr} ({', '.join(sorted(wrapped))}) holds its attention a level further down "
            f"({', '.join(sorted(set(wrapped.values())))}){', one instance shared by several layers' if shared else ''}"
            ", which ds_longseq does not look into: it runs attention modules found directly in each layer"
        ]
    if inline:
        return attention_problem, [
            f"{where}[i].{attn_attr} ({', '.join(inline)}) does not compute through transformers' attention interface "
            "with its K/V through the KV cache's update(), which ds_longseq's chunked attention replaces"
        ]
    return attention_problem, []


def _mlp(layers: list[torch.nn.Module], others: list[tuple[str, ...]]
         ) -> tuple[str | None, tuple[str, ...], tuple[int, ...]]:
    """``(mlp_attr, mlp_part_attrs, mlp_free_layers)``: the layers' MLP attribute (None where they have none in
    common); else the MLP parts beside each other when each is a block of its own (Granite-MoE-hybrid's MoE block
    and shared MLP; not bare projections such as OPT's fc1 / fc2); and the layers that are a token mixer only
    (NemotronH's attention and Mamba blocks: nothing for mini_seq to chunk)."""
    mlp_names = {names for names in others if names}
    mlp_attr = next(iter(mlp_names))[0] if len(mlp_names) == 1 and len(next(iter(mlp_names))) == 1 else None
    if mlp_attr is None and mlp_names and all("mlp" in names for names in mlp_names):
        # Other parameterised children beside it (Gemma 4's per-layer-input gate and projection, its MoE block
        # next to the dense MLP): the one transformers names mlp is the MLP; the others run stock
        mlp_attr = "mlp"
    parts: tuple[str, ...] = ()
    if mlp_attr is None and mlp_names:
        parts = tuple(dict.fromkeys(name for names in others for name in names))
        # each part a block (children of its own): mini_seq's first forward checks it is token-wise and called on
        # the hidden states alone, so a wrong guess is refused there, never run
        if not all(any(True for _ in getattr(layer, name).children())
                   for layer, names in zip(layers, others, strict=True) for name in names):
            parts = ()
    mlp_free = tuple(i for i, names in enumerate(others) if not names) if mlp_attr is not None or parts else ()
    return mlp_attr, parts, mlp_free


def _head_problems(model: torch.nn.Module, cls: str, head, head_attrs: list[str], kind: str | None) -> list[str]:
    """Why the chunked LM head would not compute what this head does (empty where it would)."""
    if not is_plain_linear(head) or not head_attrs:
        return [f"{cls}'s output embeddings are {type(head).__name__}, not a plain torch.nn.Linear child "
                "(ds_longseq's chunked head computes hidden @ weight.T + bias and nothing else)"]
    if kind == "z_loss" and getattr(model, "z_loss_coefficient", 0.0):
        return [f"{cls} adds a z-loss (z_loss_coefficient={model.z_loss_coefficient}: the squared logsumexp "
                "of every position's logits), which ds_longseq's chunked head does not compute; set "
                "config.z_loss_coefficient=0.0"]
    if kind == "hidden_scaling" and head.bias is not None:
        return [f"{cls} scales the hidden states before an LM head with a bias, which ds_longseq's chunked "
                "head (scaling the logits instead) would not reproduce"]
    return []


def _moe(layers: list[torch.nn.Module], others: list[tuple[str, ...]], mlp_attr: str | None, kind: str | None,
         where: str) -> tuple[str | None, str | None, str | None, list[str]]:
    """``(moe_attr, moe_class, router_attr, problems)`` of the layers' mixture-of-experts block: the MLP itself,
    else the one child with ``experts`` beside other MLP parts (Granite-MoE-hybrid's block_sparse_moe beside its
    shared_mlp); its router is its ``gate`` or ``router`` module."""
    problems: list[str] = []
    moe_class = router_attr = moe_attr = None
    moe_attrs = {name for i, layer in enumerate(layers) for name, child in layer.named_children()
                 if name in others[i] and hasattr(child, "experts")}
    if mlp_attr is not None and mlp_attr in moe_attrs:
        moe_attr = mlp_attr
    elif len(moe_attrs) == 1:
        moe_attr = next(iter(moe_attrs))
    elif moe_attrs:
        problems.append(f"{where}: mixture-of-experts blocks under several attributes ({sorted(moe_attrs)})")
    if moe_attr is not None:
        moe = [getattr(layer, moe_attr) for layer in layers if hasattr(getattr(layer, moe_attr, None), "experts")]
        moe_class = type(moe[0]).__name__
        routers = [a for a in _ROUTER_ATTRS if isinstance(getattr(moe[0], a, None), torch.nn.Module)]
        router_attr = routers[0] if routers else None
        if len({type(m).__name__ for m in moe}) > 1:
            problems.append(f"{where}: mixture-of-experts blocks of several classes")
    if kind in MOE_AUX_KINDS and moe_class is not None and router_attr is None:
        problems.append(
            f"{where}[i].{moe_attr} ({moe_class}) has no router (.gate or .router) whose logits the load-balancing "
            "loss reads"
        )
    return moe_attr, moe_class, router_attr, problems


def _final_norm(decoder: torch.nn.Module) -> str:
    """The decoder stack's final norm: its one norm child (``norm`` where it has none or several)."""
    norms = _child_names(decoder, _is_norm)
    return norms[0] if len(norms) == 1 else "norm"


def discover_spec(model: torch.nn.Module, family_spec_cls: type):
    """``(spec, [])`` for a model whose parts can all be located, else ``(None, problems)``.

    Problems that stop the search (no decoder stack, no single layer list, token mixers that cannot be told
    apart) end it with what was found so far; the others (head, attention, LM head, mixture of experts) are all
    collected, so one refusal lists them together.

    Args:
        model: a ``*ForCausalLM`` instance.
        family_spec_cls: ``decoder.FamilySpec`` (passed in: this module sits below the registry that uses it).
    """
    cls = type(model).__name__
    if not _is_causal_lm(type(model)):
        return None, [f"{cls} is not a causal-LM class (*ForCausalLM): ds_longseq trains decoder-only causal LMs"]
    head = model.get_output_embeddings()
    head_attrs = [name for name, child in model.named_children() if child is head]
    found = _find_decoder(model, cls)
    if isinstance(found, str):
        return None, [found]
    prefix, decoder, lists, num_layers = found
    kind = head_kind(model, prefix if "." in prefix else None, head_attrs[0] if head_attrs else "lm_head")
    problems = [] if kind is not None else [_unknown_head_problem(cls)]
    if len(lists) != 1:
        count = "no" if not lists else f"{len(lists)} ({lists})"
        return None, problems + [
            f"{cls}.{prefix} has {count} ModuleList of config.num_hidden_layers={num_layers} decoder layers"
        ]
    layers_attr = lists[0]
    layers = list(getattr(decoder, layers_attr))
    where = f"{cls}.{prefix}.{layers_attr}"
    mixers = _Mixers(layers)
    problem = mixers.problem(layers, where)
    if problem is not None:
        return None, problems + [problem]
    attention_problem, attention_refusals = _attention_problems(layers, mixers, where)
    problems += attention_refusals
    mlp_attr, mlp_parts, mlp_free = _mlp(layers, mixers.others)
    problems += _head_problems(model, cls, head, head_attrs, kind)
    moe_attr, moe_class, router_attr, moe_problems = _moe(layers, mixers.others, mlp_attr, kind, where)
    problems += moe_problems
    if problems:
        return None, problems
    config = text_config(model)
    fields = dict(
        causal_lm_class=cls,
        decoder_attr=prefix,
        layers_attr=layers_attr,
        attn_attr=mixers.attn_attr or "self_attn",
        mixer_attr=mixers.mixer_attr,
        mlp_attr=mlp_attr,
        mlp_part_attrs=mlp_parts,
        lm_head_attr=head_attrs[0],
        dropout_fields=_read_by_modules(layers, _fields(config, _DROPOUT_WORDS)),
        final_logit_softcap_field="final_logit_softcapping" if kind == "final_softcap" else None,
        moe_block_class=moe_class if kind in MOE_AUX_KINDS else None,
        moe_attr=moe_attr if kind in MOE_AUX_KINDS and moe_attr != mlp_attr else None,
        router_attr=router_attr or "gate",
        mlp_noise_fields=_fields(config, _NOISE_WORDS),
        norm_folds=(),
        norm_folds_known=False,
        final_norm_attr=_final_norm(decoder),
        head_kind=kind,
        discovered=True,
        attention_problem=attention_problem,
        sequence_parallel_verified=False,
        token_wise_layers=tuple(mixers.token_wise),
        mlp_free_layers=mlp_free,
    )
    fields.update(OVERRIDES.get(getattr(model.config, "model_type", None), {}))
    return family_spec_cls(**fields), []
