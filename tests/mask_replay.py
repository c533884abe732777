"""The reference for dropout under ds_longseq: the stock model run whole with the masks ds_longseq's forward drew.

"Exact" with dropout means: the gradient is autograd's gradient of the very function the forward computed, with
the masks it drew. :class:`MaskRecorder` watches a ds_longseq forward and keeps, for every dropout call site, the
masks each call drew (a chunked module calls its site once per chunk, in token order); :class:`MaskReplayer`
runs the stock model whole with each site's masks joined along the tokens put in place of its draws. Comparing
loss and gradients of the two (float64, 1e-10) checks the whole chain: the forward's masks, the backward's replay
of them (a backward that drew other masks would give another gradient), and that nothing else differs.

A call site is (the innermost module whose forward is running, the line of code that made the call): an
``nn.Dropout`` module (PEFT's ``lora_dropout`` among them) is its own site; a functional dropout inside a layer's
code is the layer's line (a StreamBP layer runs its stock forward once per chunk inside one call of the module).
Router noise (``Tensor.uniform_``, Mixtral's jitter) is recorded and replayed the same way, as its values.

Shape legend: B batch, C chunk, T sequence.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_DROPOUT_FUNCTIONS = (F.dropout, torch.dropout)
_NOISE_FUNCTIONS = (torch.Tensor.uniform_,)
# frames of the dropout machinery itself, skipped to find the line that called it (an nn.Dropout module called
# twice in a layer, as Emu3's residual dropout, is two sites: the two lines of the layer that call it)
_MACHINERY = ("torch/nn/functional.py", "torch/overrides.py", "torch/utils/_device.py", "torch/nn/modules/dropout.py",
              "torch/nn/modules/module.py", __file__)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_MACHINERY):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _ModuleStack:
    """The modules whose forward is running (global module hooks), each with its count of dropout calls so far."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.handles = []

    def __enter__(self):
        def pre(module, args):
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def post(module, args, out):
            self.stack.pop()

        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                        torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.stack.clear()

    def site(self) -> tuple[str, str]:
        return (self.stack[-1] if self.stack else "<model>", _caller())


class _SiteMode(TorchFunctionMode):
    """A function mode that knows each call's site (:class:`_ModuleStack` over ``model``) while it is on."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.modules = _ModuleStack(model)

    def __enter__(self):
        self.modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.modules.__exit__(*exc)


def _capturing() -> bool:
    """Whether a StreamBP K/V capture pass is running the current chunk."""
    from ds_longseq.forwards.attn_spec import spec_of

    spec = spec_of({})
    return spec is not None and getattr(spec.stream, "mode", None) in ("capture", "capture_grad")


def _dropout_args(func, args, kwargs) -> tuple[torch.Tensor, float, bool]:
    x = args[0]
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    return x, float(p), bool(training)


class MaskRecorder(_SiteMode):
    """Within: every dropout call with p > 0 in training runs as usual and its mask is recorded under its call site:
    ``masks[site]`` lists them in call order.

    The mask is drawn again from the generator state the call started from, as torch's CPU dropout draws it
    (``empty_like(x).bernoulli_(1 - p)``), and checked against the call's output wherever the input is nonzero (an
    exact zero, such as a padded query's attention output, hides the mask in the output but not in the
    gradient). Draws of a StreamBP K/V capture pass (under sequence parallelism the forward captures every chunk's
    keys before running the chunks) are not the forward's function: not recorded (that they equal the forward's is
    what the reference checks, through the keys the forward attends)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.masks: dict[tuple, list[torch.Tensor]] = {}
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NOISE_FUNCTIONS and not _capturing():
            out = func(*args, **kwargs)
            self.masks.setdefault(self.modules.site(), []).append(out.detach().clone())
            self.calls += 1
            return out
        if func not in _DROPOUT_FUNCTIONS:
            return func(*args, **kwargs)
        if _capturing():
            return func(*args, **kwargs)
        x, p, training = _dropout_args(func, args, kwargs)
        if x.device.type != "cpu":  # CUDA's fused dropout draws by its own scheme: the mask read off the output
            out = func(*args, **kwargs)
            if training and p > 0:
                if bool((x == 0).any()):
                    raise AssertionError("a CUDA dropout input holds exact zeros: its mask cannot be read from the "
                                         "output (use a batch without padding)")
                self.masks.setdefault(self.modules.site(), []).append(out != 0)
                self.calls += 1
            return out
        before = torch.get_rng_state()
        out = func(*args, **kwargs)
        if training and p > 0:
            after = torch.get_rng_state()
            torch.set_rng_state(before)
            mask = torch.empty_like(x).bernoulli_(1 - p).bool()
            torch.set_rng_state(after)
            nonzero = x != 0
            if not torch.equal((out != 0) & nonzero, mask & nonzero):
                raise AssertionError("torch's CPU dropout no longer draws its mask as empty_like(x).bernoulli_(1 - p)")
            self.masks.setdefault(self.modules.site(), []).append(mask)
            self.calls += 1
        return out


class MaskReplayer(_SiteMode):
    """Within: each dropout call site applies ``whole[site]`` (the recorded masks joined along the tokens) instead
    of drawing, as torch's CPU dropout computes it (``x * (mask / (1 - p))``). A site with no mask, or one of
    another shape, fails the test."""

    def __init__(self, model: torch.nn.Module, whole: dict[tuple, torch.Tensor]):
        super().__init__(model)
        self.whole = whole
        self.used: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NOISE_FUNCTIONS:
            out = func(*args, **kwargs)
            return out.copy_(self._recorded(self.modules.site(), out))
        if func not in _DROPOUT_FUNCTIONS:
            return func(*args, **kwargs)
        x, p, training = _dropout_args(func, args, kwargs)
        if not (training and p > 0):
            return func(*args, **kwargs)
        mask = self._recorded(self.modules.site(), x)
        return x * (mask.to(x.dtype) / (1 - p))

    def _recorded(self, site, x: torch.Tensor) -> torch.Tensor:
        if site not in self.whole and (site[0], None) in self.whole:
            site = (site[0], None)  # a mask of the module's one dropout call (attention probabilities, tapped)
        mask = self.whole.get(site)
        if mask is None or mask.shape != x.shape:
            raise AssertionError(f"dropout site {site} of shape {tuple(x.shape)}: recorded "
                                 f"{None if mask is None else tuple(mask.shape)}")
        self.used.add(site)
        return mask


def joined(masks: dict[tuple, list[torch.Tensor]], batch: int) -> dict[tuple, torch.Tensor]:
    """Each site's chunk masks (in token order) joined along the tokens: (B, C, ...) chunks along dim 1, chunks
    flattened to (B * C, ...) (OPT's second dropout, an MoE's flat tokens) as (B, C, ...) and flattened back."""
    whole = {}
    for site, chunks in masks.items():
        if chunks[0].shape[0] == batch:
            whole[site] = torch.cat(chunks, dim=1)
        else:
            parts = [c.view(batch, -1, *c.shape[1:]) for c in chunks]
            whole[site] = torch.cat(parts, dim=1).flatten(0, 1)
    return whole


def against_mask_replay(ours, stock, batch, seed: int = 5, dtype: torch.dtype = torch.float64,
                        attention_heads: int | None = None):
    """(errors of ``ours`` (loss, input gradient, every parameter gradient: ``tests.helpers.compare``) against
    ``stock`` run whole with the masks ``ours``'s forward drew (its loss from ``dtype`` logits), the recorder).

    ``attention_heads``: the model's query heads, to also tap the attention-probability masks ds_longseq's chunk
    attention draws (:class:`AttentionDropoutTap`, kept as ``recorder.tap``); the stock model must then run an
    eager attention whose dropout is ``F.dropout`` (``tests.helpers.float64_eager_attention``)."""
    from tests.helpers import compare, grads_of, reference_loss

    B, T = batch["input_ids"].shape
    torch.manual_seed(seed)
    recorder = MaskRecorder(ours)
    recorder.tap = tap = AttentionDropoutTap(ours, B, attention_heads or 1, T)

    def forward():
        with recorder:
            if attention_heads is None:
                return ours(**batch).loss
            with tap:
                return ours(**batch).loss

    result = grads_of(ours, forward)
    whole = {**joined(recorder.masks, B), **tap.whole()}
    replayer = MaskReplayer(stock, whole)

    def reference():
        with replayer:
            return reference_loss(stock, batch, dtype)

    errs = compare(result, grads_of(stock, reference))
    assert replayer.used == set(whole), "a recorded draw was not replayed"
    return errs, recorder


class AttentionDropoutTap:
    """Within: every attention-probability dropout mask ds_longseq's chunk attention draws in a module's forward
    (``ops.tile_kernels.dropout_masks_tapped``) put in place in that module's whole (B, H, T, T) mask: ``masks``
    keyed (module, None), as :class:`MaskReplayer` takes them for the stock eager attention's one dropout call. A mask
    position drawn twice (a chunk run again in the forward) must be drawn the same.

    ``local_heads``: the global indices of the query heads this process's tiles hold (a sequence-parallel rank's
    Ulysses heads, in order); None: all ``heads``. ``seen`` marks what was drawn (ranks' masks are joined by it)."""

    def __init__(self, model: torch.nn.Module, batch: int, heads: int, seq_len: int,
                 local_heads: torch.Tensor | None = None):
        from ds_longseq.ops.tile_kernels import dropout_masks_tapped

        self.modules = _ModuleStack(model)
        self.shape = (batch, heads, seq_len, seq_len)
        self.heads = torch.arange(heads) if local_heads is None else local_heads
        self.masks: dict[tuple, torch.Tensor] = {}
        self.tiles = 0
        self._tapped = dropout_masks_tapped(self._tap)

    def __enter__(self):
        self.modules.__enter__()
        self._tapped.__enter__()
        return self

    def __exit__(self, *exc):
        self._tapped.__exit__(*exc)
        self.modules.__exit__(*exc)

    def _tap(self, keep: torch.Tensor, mask) -> None:
        key0, query0, stacked = mask.dropout_where
        B, h, r, n = keep.shape
        if stacked:  # (B, Hkv, R * rows, n): R blocks of the rows, one per query head of the key/value head
            groups = len(self.heads) // h
            keep = keep.reshape(B, h, groups, r // groups, n).reshape(B, h * groups, -1, n)
        rows = keep.shape[2]
        whole = self.masks.setdefault((self.modules.stack[-1], None), torch.zeros(self.shape, dtype=torch.bool))
        seen = self.masks.setdefault(("seen", self.modules.stack[-1]), torch.zeros(self.shape, dtype=torch.bool))
        place = (slice(None), self.heads, slice(query0, query0 + rows), slice(key0, key0 + n))
        if seen[place].any() and not torch.equal(whole[place][seen[place]], keep.cpu()[seen[place]]):
            raise AssertionError("a tile drew another mask than an earlier run of it")
        whole[place] = keep.cpu()
        seen[place] = True
        self.tiles += 1

    def whole(self) -> dict[tuple, torch.Tensor]:
        return {site: m for site, m in self.masks.items() if site[0] != "seen"}
