"""The family sweep: every causal-LM ``model_type`` of the installed transformers, tiny, stock against ds_longseq.

Holds:
    MODES: the two ds_longseq configurations every family is tried in.
    full_float64: a context that keeps float64 where stock code rounds to float32 inside.
    check_family: one family in one mode -> a ``Result`` (exact with its error, refused with the reason,
        or a failure: a crash or a difference).
    sweep: every family in every mode (cached per process), with a progress line per family.
    render_markdown: ``docs/SUPPORTED_MODELS.md`` from a sweep.
    main: ``python -m tests.model_sweep [--write] [model_type ...]`` prints (and writes) the table.

Why one patch of torch's casts and not per-family patches: stock modules round to float32 inside a float64
model in many places (eager softmax, RMSNorms' ``.float()``, routers' softmax, the loss's logits upcast),
each written differently per family. Under :class:`full_float64` a cast of a float64 tensor to float32
(``.float()``, ``.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``) keeps float64; both the
stock reference and ds_longseq's run go through it, so they compare at float64 (1e-10) and the tolerance
says nothing about float32 rounding. It is active through forward and backward (StreamBP re-forwards in backward).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

import ds_longseq
from ds_longseq import UnsupportedModelError
from ds_longseq.forwards import mlp as mlp_module
from ds_longseq.forwards import streambp_layer
from tests import model_zoo
from tests.helpers import grads_of

__all__ = ["MODES", "TOLERANCE", "Result", "full_float64", "check_family", "worst_error", "sweep", "render_markdown",
           "main"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "SUPPORTED_MODELS.md"

# 40 tokens (model_zoo.tiny_batch): StreamBP chunks 13, 13, 13, 1 (uneven last chunk, 4 chunks), attention
# tiles of 5 keys, LM-head chunks of 17 valid tokens; mini-sequence MLPs in 3 uneven chunks.
MODES = {
    "streambp": {
        "streambp": {"enabled": True, "chunk_size": 13},
        "attention": {"kv_block_size": 5},
        "lm_head": {"enabled": True, "chunk_size": 17},
    },
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 17}},
}
TOLERANCE = 1e-10
"""Norm-wise relative error allowed on the loss, the input-embedding gradient and each parameter gradient,
both sides in float64 throughout (see the module docstring)."""


_LOW = (torch.float32, torch.float16, torch.bfloat16)


def _keep64(fn, method: bool):
    """``fn`` with any float32/16 dtype argument turned into float64 when its tensor is float64."""

    def wrapper(*args, **kwargs):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.dtype == torch.float64:
            if kwargs.get("dtype") in _LOW:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if (i > 0 or not method) and a in _LOW else a for i, a in enumerate(args))
        return fn(*args, **kwargs)

    return wrapper


def _matmul64(fn):
    """``fn`` (a matrix product) with a float32/16 operand turned float64 when the other is float64: a float64
    buffer (rotary ``inv_freq``) times positions cast by ``.float()``, which transformers 5.16 multiplies as a matrix
    product (5.24 elementwise, promoting)."""

    def wrapper(a, b, *args, **kwargs):
        dtypes = {getattr(a, "dtype", None), getattr(b, "dtype", None)}
        if torch.float64 in dtypes and dtypes & set(_LOW):
            a, b = a.to(torch.float64), b.to(torch.float64)
        return fn(a, b, *args, **kwargs)

    return wrapper


class full_float64:
    """Keep float64 wherever stock code would round to float32 (see the module docstring).

    Patches the casts and the ``dtype=`` reductions stock modules use, on the classes and modules themselves
    (not a torch-function mode: modes are not active inside autograd's backward, where StreamBP re-forwards),
    and restores them on exit. Not thread-safe; for tests.
    """

    _METHODS = ("to", "type", "softmax", "log_softmax")
    _FUNCTIONS = ((torch, "softmax"), (torch, "log_softmax"), (torch.nn.functional, "softmax"),
                  (torch.nn.functional, "log_softmax"))

    def __enter__(self):
        self._saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in (*self._METHODS, "float")]
        self._saved += [(module, name, getattr(module, name)) for module, name in self._FUNCTIONS]
        self._saved += [(torch.Tensor, "__matmul__", torch.Tensor.__matmul__), (torch, "matmul", torch.matmul)]
        torch.Tensor.__matmul__ = _matmul64(torch.Tensor.__matmul__)
        torch.matmul = _matmul64(torch.matmul)
        for name in self._METHODS:
            setattr(torch.Tensor, name, _keep64(getattr(torch.Tensor, name), method=True))
        float_ = torch.Tensor.float
        torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else float_(self, *a, **k)
        for module, name in self._FUNCTIONS:
            setattr(module, name, _keep64(getattr(module, name), method=False))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


@dataclasses.dataclass
class Result:
    """One family in one mode."""

    model_type: str
    mode: str
    outcome: str
    """"exact", "refused" (``UnsupportedModelError`` at enable, or ``NotImplementedError`` from the runtime
    guard at the first forward), "unbuildable" (the tiny model itself cannot be built or run), "crash" or
    "different"."""
    detail: str = ""
    """The error for exact; the one-line reason for the others."""
    seconds: float = 0.0
    variant: str = "default"
    """The tiny config's variant (``model_zoo.VARIANTS``): the default, or what published checkpoints carry."""

    @property
    def ok(self) -> bool:
        return self.outcome in ("exact", "refused", "unbuildable")


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``||a - b|| / max(||b||, floor)``."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(max(floor, 1e-300))).item()


FLOOR = 1e-5
"""A gradient is compared relative to at least ``FLOOR`` x the largest parameter gradient's norm: one that is
zero in exact arithmetic holds only rounding noise, whose relative error means nothing. Such gradients: a top-1
router's weight (its renormalised routing weight is exactly 1, noise ~1e-17), and a key projection's bias (a
constant added to every key adds the same q . b to all of a query's scores, which softmax ignores): Granite-MoE-
hybrid's with the published config's attention bias holds noise of 1.2e-16 x the largest gradient, 1.2e-10 against
a floor of 1e-6 of it. 1e-5: such noise is judged at ~1e-11, and no other gradient is affected (checked over
both config variants of every family, 2026-11-27: no parameter gradient's norm lies between 1e-13 and 1e-5 of the
largest)."""


def worst_error(result, reference) -> tuple[str, float]:
    """(name, relative error) of the worst of the loss, the input-embedding gradient and every parameter gradient of
    ``result`` against ``reference`` (each ``(loss, {name: grad}, input grad)``), a parameter gradient compared
    against at least :data:`FLOOR` x the largest reference gradient's norm."""
    loss, grads, embeds = result
    ref_loss, ref_grads, ref_embeds = reference
    errors = {"loss": _rel(loss, ref_loss), "input_grad": _rel(embeds, ref_embeds)}
    floor = FLOOR * max(g.double().norm().item() for g in ref_grads.values())
    errors.update({f"grad:{n}": _rel(grads[n], ref_grads[n], floor) for n in ref_grads})
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def _loss_and_grads(model, batch, watch: tuple = ()):
    """(loss, {name: grad, zeros where none}, input-embedding-output grad), forward and backward in full float64;
    the contexts in ``watch`` (a mask recorder, tap or replayer: tests/mask_replay.py) around the forward only."""

    def forward():
        with contextlib.ExitStack() as stack:
            for context in watch:
                stack.enter_context(context)
            return model(**batch).loss

    with full_float64():
        loss, grads, embeds = grads_of(model, forward)
    grads = {n: grads[n] if n in grads else torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    return loss, grads, embeds


def _draws_dropout(model) -> bool:
    """Whether the model's config sets a dropout (a published config: ``model_zoo.VARIANTS``)."""
    return bool(model_zoo.dropout_fields(model.config))


class _ReplayedDraws:
    """The reference of a model whose forward draws dropout masks (the published configs' dropouts at their
    values): ds_longseq's forward runs under a mask recorder and its chunk attention's tap, and the stock model
    (kept aside before ``enable``, its attention eager so that its attention dropout is a visible ``F.dropout``)
    runs whole with those masks in place of its draws (tests/mask_replay.py: exact means the gradient of the very
    function the forward computed, with the masks it drew)."""

    def __init__(self, model, batch: dict):
        self.stock = copy.deepcopy(model)
        self.stock.set_attn_implementation("eager")
        self.batch = batch
        self.heads = model.config.get_text_config().num_attention_heads

    def ours(self, ours_model) -> tuple:
        """ds_longseq's (loss, grads, input grad), its draws recorded: a first step before, so the first forward's
        one-time probes (which run modules on probe inputs) draw outside the recorded one."""
        from tests.mask_replay import AttentionDropoutTap, MaskRecorder

        _loss_and_grads(ours_model, self.batch)
        torch.manual_seed(0)
        B, T = self.batch["input_ids"].shape
        self.recorder, self.tap = MaskRecorder(ours_model), AttentionDropoutTap(ours_model, B, self.heads, T)
        return _loss_and_grads(ours_model, self.batch, (self.recorder, self.tap))

    def reference(self) -> tuple:
        from tests.mask_replay import MaskReplayer, joined

        whole = {**joined(self.recorder.masks, self.batch["input_ids"].shape[0]), **self.tap.whole()}
        replayer = MaskReplayer(self.stock, whole)
        result = _loss_and_grads(self.stock, self.batch, (replayer,))
        assert replayer.used == set(whole), "a recorded draw was not replayed"
        return result


class _ChunkedCalls:
    """Which layers / MLPs ran chunk by chunk (a family that quietly fell back to the stock forward would
    otherwise pass as exact): a StreamBP layer is counted when one of its chunks passed the runtime guard
    (``streambp_layer._check_chunk_attended``), an MLP when ``mini_sequence_apply`` ran on its parameters."""

    def __init__(self):
        self.layers: set[int] = set()
        self.mlps: set[int] = set()  # id of each chunked MLP's first parameter
        self._saved = []

    def __enter__(self):
        guard, apply = streambp_layer._check_chunk_attended, mlp_module.mini_sequence_apply

        def checked(name, layer, *args, **kwargs):
            self.layers.add(id(layer))
            return guard(name, layer, *args, **kwargs)

        def chunked(fn, x, params, *args, **kwargs):
            if params:
                self.mlps.add(id(params[0]))
            return apply(fn, x, params, *args, **kwargs)

        self._saved = [(streambp_layer, "_check_chunk_attended", guard), (mlp_module, "mini_sequence_apply", apply)]
        streambp_layer._check_chunk_attended, mlp_module.mini_sequence_apply = checked, chunked
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [line.strip(" -") for line in text.splitlines() if line.strip(" -")]
    # the enable() message: a header line, then one line per problem
    return lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]


def _stock_forward_runs(model, batch: dict) -> bool:
    """Whether the stock model's forward runs on ``batch`` (no grad, generators kept). With the load-balancing loss
    switched on, transformers 5.16's Granite-MoE and DBRX models fail (their decoders record no router logits:
    ``aux_loss.to`` on the int 0), as does Doge's dense default (an empty tuple of them): those families are checked
    with the loss off, as they ship; ds_longseq refuses it there (test_unrecorded_router_logits_are_refused)."""
    with torch.random.fork_rng(), torch.no_grad():
        try:
            model(**batch)
        except Exception:  # noqa: BLE001 - any failure: the reference would fail the same way
            return False
    return True


def check_family(model_type: str, mode: str, batch: dict | None = None, variant: str = "default") -> Result:
    """Build ``model_type`` tiny in float64 (its config's ``variant``), run it stock and under ds_longseq ``mode`` on
    ``batch`` (default: ``model_zoo.tiny_batch``), compare."""
    result = _check_family(model_type, mode, batch, variant)
    result.variant = variant
    return result


def _check_family(model_type: str, mode: str, batch: dict | None, variant: str) -> Result:
    start = time.perf_counter()
    if model_type in model_zoo.UNBUILDABLE:
        return Result(model_type, mode, "unbuildable", model_zoo.UNBUILDABLE[model_type])
    try:
        model = model_zoo.tiny_model(model_type, torch.float64, variant=variant)
    except Exception as error:  # noqa: BLE001 - a published-style config the family itself rejects
        if variant == "default":
            raise
        return Result(model_type, mode, "unbuildable", f"{variant} config: {_one_line(error)}")
    model.train()
    batch = model_zoo.tiny_batch(model_type) if batch is None else batch
    text = model.config.get_text_config()
    if getattr(text, "output_router_logits", None) is False:
        # the load-balancing loss on, large enough to bite (off in the defaults), where the stock forward computes it
        text.output_router_logits = True
        if _stock_forward_runs(model, batch):
            for owner in (text, model):
                if isinstance(getattr(owner, "router_aux_loss_coef", None), float):
                    owner.router_aux_loss_coef = 0.5
        else:
            text.output_router_logits = False
    replayed = _ReplayedDraws(model, batch) if _draws_dropout(model) else None
    reference = _loss_and_grads(model, batch) if replayed is None else None
    try:
        ours_model = ds_longseq.enable(model, MODES[mode])
    except UnsupportedModelError as error:
        return Result(model_type, mode, "refused", _one_line(error), time.perf_counter() - start)
    try:
        with _ChunkedCalls() as calls:
            ours = _loss_and_grads(ours_model, batch) if replayed is None else replayed.ours(ours_model)
    except NotImplementedError as error:  # the runtime guard, or an attention argument nobody handles
        return Result(model_type, mode, "refused", _one_line(error), time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - a crash is a result here, reported with its type
        return Result(model_type, mode, "crash", _one_line(error), time.perf_counter() - start)
    finally:
        ds_longseq.disable(model)
    if replayed is not None:
        reference = replayed.reference()
    seconds = time.perf_counter() - start
    adapter = ds_longseq.patch.check_model(model, MODES[mode])
    wanted = {id(layer) for layer in adapter.layers} if mode == "streambp" else {
        id(next(mlp.parameters())) for layer in adapter.layers for mlp in adapter.mlp_parts(layer)
    }
    ran = calls.layers if mode == "streambp" else calls.mlps
    if not wanted <= ran:
        return Result(model_type, mode, "different",
                      f"the chunked path ran on {len(wanted & ran)} of {len(wanted)} layers", seconds)
    if set(ours[1]) != set(reference[1]):
        return Result(model_type, mode, "different", f"parameters differ: {sorted(set(ours[1]) ^ set(reference[1]))}")
    worst, error = worst_error(ours, reference)
    if not error < TOLERANCE:  # (NaN fails too)
        return Result(model_type, mode, "different", f"{worst} relative error {error:.2e}", seconds)
    return Result(model_type, mode, "exact", f"{error:.1e}", seconds)


_CACHE: dict[tuple[str, str, str], Result] = {}

COLUMNS = (("streambp", "default"), ("mini_seq", "default"), ("streambp", "published"))
"""The (mode, config variant) pairs every family is checked in: both modes on the default config, and StreamBP
(the mode whose checks read the most of a config: windows, dropouts, head) on the published-style one."""


def cached_check(model_type: str, mode: str, variant: str = "default") -> Result:
    """:func:`check_family`, once per process (the per-family tests and the docs test share the runs)."""
    key = (model_type, mode, variant)
    if key not in _CACHE:
        torch.manual_seed(0)
        _CACHE[key] = check_family(model_type, mode, variant=variant)
    return _CACHE[key]


def sweep(model_types: list[str] | None = None, progress: bool = False) -> list[Result]:
    """Every (family, column) result, families sorted, columns in :data:`COLUMNS` order."""
    results = []
    types = model_types or model_zoo.causal_lm_model_types()
    for i, model_type in enumerate(types):
        for mode, variant in COLUMNS:
            results.append(cached_check(model_type, mode, variant))
        if progress:
            row = results[-len(COLUMNS):]
            print(f"[{i + 1}/{len(types)}] {model_type}: "
                  + ", ".join(f"{r.mode}/{r.variant} {r.outcome}" for r in row), file=sys.stderr, flush=True)
    return results


def render_markdown(results: list[Result]) -> str:
    """``docs/SUPPORTED_MODELS.md``: the per-family table and the totals, generated from a sweep."""
    import transformers

    by_type: dict[str, dict[tuple[str, str], Result]] = {}
    for r in results:
        by_type.setdefault(r.model_type, {})[(r.mode, r.variant)] = r
    counts = {column: sum(row[column].outcome == "exact" for row in by_type.values()) for column in COLUMNS}
    both = sum(all(row[(m, "default")].outcome == "exact" for m in MODES) for row in by_type.values())
    lines = [
        "# Supported models",
        "",
        "Generated by `python -m tests.model_sweep --write` (checked current by `tests/test_model_sweep.py`); do",
        "not edit by hand.",
        "",
        f"Every causal-LM `model_type` of transformers {transformers.__version__} ({len(by_type)} families), built",
        "tiny from its default config with its features switched on at the test length (`tests/model_zoo.py`),",
        "trained stock and under ds_longseq in float64 on CPU, in two modes:",
        "",
        "- **streambp**: StreamBP (chunks of 13 tokens over 40, attention tiles of 5 keys) + chunked LM head;",
        "- **mini_seq**: mini-sequence MLP (3 chunks) + chunked LM head;",
        "",
        "and StreamBP again on the **published**-style config: what published checkpoints' configs carry beside",
        "transformers' defaults (sliding windows at their default size and switch, e.g. Qwen's",
        "`use_sliding_window: false` with a window set; every dropout at its default, e.g. GPT-2's 0.1 on its",
        "embeddings, attention probabilities and residuals, where the reference is the stock model run whole with",
        "the masks ds_longseq's forward drew, `tests/mask_replay.py`; YaRN RoPE scaling; the attention and MLP bias",
        "switches on; the LM head's tying flipped).",
        "",
        f"**exact** means the loss, the input-embedding gradient and every parameter gradient agree to "
        f"{TOLERANCE:g} (norm-wise relative, a gradient against at least {FLOOR:g} x the largest gradient's norm;",
        "`python -m tests.model_sweep` prints the largest error) and the chunked path ran on every layer;",
        "both sides compute in float64 throughout (stock code's float32 casts kept at float64, see",
        "`tests/model_sweep.py`). **refused** means ds_longseq raises `UnsupportedModelError` at `enable()` (or the",
        "runtime guard raises at the first forward) with the reason shown; nothing is trained wrongly.",
        "",
        f"Exact in both modes: **{both}** families; streambp: {counts[('streambp', 'default')]}; mini_seq: "
        f"{counts[('mini_seq', 'default')]}; streambp on the published-style config: "
        f"{counts[('streambp', 'published')]}.",
        "",
        "| model_type | streambp | mini_seq | streambp, published config |",
        "| --- | --- | --- | --- |",
    ]

    def cell(r: Result) -> str:
        if r.outcome == "exact":  # (the error itself varies in its last digits with the thread count)
            return "exact"
        return f"{r.outcome}: {r.detail}".replace("|", "\\|")

    for model_type in sorted(by_type):
        row = by_type[model_type]
        lines.append(f"| `{model_type}` | " + " | ".join(cell(row[c]) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="families to run (default: all)")
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(DOC.parent.parent)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = sweep(args.model_types or None, progress=True)
    for r in results:
        print(f"{r.model_type:28s} {r.mode:9s} {r.variant:9s} {r.outcome:11s} {r.seconds:6.2f}s {r.detail}")
    if args.write:
        if args.model_types:
            parser.error("--write needs the whole sweep (no model types)")
        DOC.write_text(render_markdown(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
