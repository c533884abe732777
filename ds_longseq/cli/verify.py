"""``ds-longseq verify``: proof on the user's own model, config and recipe that ds_longseq's step is exact.

One forward and backward of the user's checkpoint (its first K decoder layers with the real head when the whole model
would not fit) on their data or on random tokens, through stock transformers and through the ``long_seq`` section
of their DeepSpeed config, with the same weights and the same inputs; then the loss difference, the worst relative
gradient difference per parameter group, and a verdict against the tolerance of the dtype (docs/VERIFY.md):

    float64   every relative difference <= 1e-10 against the stock model in float64 (the test suite's check)
    float32   <= max(1e-5, 1.5 x the stock float32 model's own difference), both against the float64 reference
    bf16      worst and mean <= 1.5 x the stock bf16 model's own, both against the float64 reference (the StreamBP
              paper's App. B.1 protocol, as tests/test_sequence_parallel.py)

The length is at least two of the config's chunks per rank, so the chunked paths run. With
``long_seq.sequence_parallel.size = P`` the check runs on P ranks (DeepSpeed's launcher is started when none is):
each rank runs ds_longseq on its shard, the gradients are summed over the group, and rank 0 compares them with one
process's stock run on the whole batch. Approx-BP is approximate (or re-parameterises the weights) by design: such a
config is reported not exact, with its measured difference.

Holds:
    main: the subcommand (``ds-longseq verify``); returns the exit status (0 exact, 1 not exact, 2 bad input).
    build_parser: its flags.
    largest_chunk / min_seq_len / default_seq_len: the config's largest chunk, the shortest length that runs two
        chunks per rank, and the length used by default.
The model, the inputs, the runs and the verdict's rules: :mod:`ds_longseq.toolkit.exactness`.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from typing import Callable

import torch

from ds_longseq.config import LongSeqConfig, LongSeqConfigError
from ds_longseq.families import UnsupportedModelError
from ds_longseq.toolkit.args import exit_status
from ds_longseq.toolkit.exactness import (
    BATCH_ROWS,
    Result,
    data_batch,
    float64_throughout,
    group_errors,
    judge,
    layers_that_fit,
    load_checkpoint,
    random_batch,
    relative_errors,
    run_model,
    stock_loss,
    tolerance_for,
    truncated_config,
)
from ds_longseq.toolkit.pretrained import gguf_parts

__all__ = ["main", "build_parser", "largest_chunk", "min_seq_len", "default_seq_len", "EXIT_EXACT", "EXIT_NOT_EXACT",
           "DTYPES"]

EXIT_EXACT, EXIT_NOT_EXACT = 0, 1
"""``ds-longseq verify``'s statuses besides bad input (2): within the dtype's tolerance, or not."""
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype``'s choices."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``ds-longseq verify``."""
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="One forward and backward of your model through stock transformers and through your config's "
                    "long_seq section: loss and gradient differences, and whether they are exact (docs/VERIFY.md)",
        epilog="exit status: 0 exact (within the dtype's tolerance); 1 not exact (or an approximate technique); "
               "2 bad input, one line on stderr; another status is a genuine error, with its traceback")
    p.add_argument("--model", required=True, help="local HF causal-LM directory or .gguf file (from_pretrained)")
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", required=True,
                   help="DeepSpeed JSON config with a long_seq section: a path, or a shipped config's name")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row; default: two and a half of the config's largest chunk per rank (an uneven "
                        "last chunk); at least two chunks per rank")
    p.add_argument("--layers", type=int, default=None,
                   help="check the first K decoder layers (with the real final norm and head); default: all of "
                        "them, or as many as fit in memory in float64")
    p.add_argument("--dtype", choices=list(DTYPES), default="float64",
                   help="the dtype of the checked run; the reference is float64 (float64: the strictest check)")
    p.add_argument("--data", default=None, help="JSONL (as ds-longseq train's --data): its first rows instead of "
                                                "random tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens and of any weight the checkpoint "
                                                       "lacks (the same in both runs)")
    return p


def main(argv: list[str] | None = None, *, prog: str = "ds-longseq verify",
         launch: Callable[[int, list[str]], int] | None = None) -> int:
    """``ds-longseq verify``; returns the exit status. ``launch(ranks, argv)``: starts DeepSpeed's launcher over
    ``ranks`` ranks of this subcommand (the caller's, so this module needs nothing of the command's package)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return exit_status(lambda a: _verify(a, prog, launch), argv)


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"verify: {text}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before any weight is read, naming the flag."""
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: pass a number of decoder layers >= 1, or leave it out")
    if args.seq_len is not None and args.seq_len < 2:
        raise SystemExit(f"--seq-len {args.seq_len}: pass a length of at least 2 tokens")
    try:
        gguf = gguf_parts(args.model)
    except (FileNotFoundError, ImportError) as err:  # a .gguf path that is missing, or no gguf package to read it
        raise SystemExit(str(err)) from None
    if gguf is None and not os.path.isdir(args.model):
        raise SystemExit(f"--model {args.model}: no such directory: pass a Hugging Face model directory or a .gguf "
                         "file")
    if args.data is not None and not os.path.isfile(args.data):
        raise SystemExit(f"--data {args.data}: no such file: pass a JSONL file, or leave --data out for random tokens")


def _long_seq(ds_config: str) -> LongSeqConfig:
    from ds_longseq.resolver import resolve
    from ds_longseq.toolkit.distributed import resolve_or_exit

    long_seq = resolve_or_exit(ds_config, lambda: resolve(ds_config)).long_seq
    if long_seq.adjoint.enabled:
        raise SystemExit(f"--ds_config {ds_config}: long_seq.adjoint is for ds_longseq's own SSM models, whose "
                         "gradients tests/test_adjoint.py checks; verify checks the transformer techniques")
    if not long_seq.any_enabled:
        raise SystemExit(f"--ds_config {ds_config} has no long_seq technique switched on: nothing to verify; add a "
                         "long_seq section (ds-longseq configs lists examples)")
    return long_seq


def largest_chunk(long_seq: LongSeqConfig) -> int:
    """The config's largest chunk in tokens per rank (0: none has a size in tokens)."""
    sizes = []
    if long_seq.streambp.enabled and isinstance(long_seq.streambp.chunk_size, int):
        sizes.append(long_seq.streambp.chunk_size)
    if long_seq.lm_head.enabled:
        sizes.append(long_seq.lm_head.chunk_size)
    if long_seq.attention.kv_block_size is not None and (long_seq.streambp.enabled or long_seq.mini_seq.enabled
                                                          or long_seq.sequence_parallel.enabled):
        sizes.append(long_seq.attention.kv_block_size)
    if long_seq.mini_seq.enabled:
        sizes.append(long_seq.mini_seq.mlp_num_chunks)  # a chunk count: T >= 2 x it gives every chunk two tokens
    return max(sizes, default=0)


def min_seq_len(long_seq: LongSeqConfig) -> int:
    """Two of the config's largest chunks on each of the sequence-parallel ranks."""
    return 2 * max(largest_chunk(long_seq), 1) * long_seq.sequence_parallel.size


def default_seq_len(long_seq: LongSeqConfig) -> int:
    """Two and a half chunks per rank (the last one uneven), a multiple of 2 P (what a ring needs)."""
    chunk, size = largest_chunk(long_seq), long_seq.sequence_parallel.size
    local = 2 * chunk + max(chunk // 2, 1) if chunk else 32
    return math.ceil(local * size / (2 * size)) * 2 * size


def _describe(long_seq: LongSeqConfig) -> str:
    parts = []
    if long_seq.streambp.enabled:
        parts.append(f"streambp chunk {long_seq.streambp.chunk_size}")
    if long_seq.mini_seq.enabled:
        parts.append(f"mini_seq {long_seq.mini_seq.mlp_num_chunks} MLP chunks")
    if long_seq.lm_head.enabled:
        parts.append(f"lm_head chunk {long_seq.lm_head.chunk_size}")
    if long_seq.attention.kv_block_size is not None:
        parts.append(f"kv_block_size {long_seq.attention.kv_block_size}")
    if long_seq.offload.layer_inputs or long_seq.offload.keep_every > 1:
        parts.append(f"offload {long_seq.offload.layer_inputs or 'device'} keep_every {long_seq.offload.keep_every}")
    if long_seq.approx_bp.enabled:
        approx = long_seq.approx_bp
        parts.append("approx_bp " + " ".join(f"{k}={v}" for k, v in (("activation", approx.activation),
                                                                      ("norm", approx.norm)) if v is not None))
    if long_seq.sequence_parallel.enabled:
        parts.append(f"sequence parallel {long_seq.sequence_parallel.size}")
    return ", ".join(parts)


def _approximate(long_seq: LongSeqConfig) -> str | None:
    """Why the config cannot be exact by design (None: it should be)."""
    approx = long_seq.approx_bp
    reasons = []
    if approx.activation is not None:
        reasons.append(f"approx_bp.activation={approx.activation!r} backpropagates a fitted step function, not the "
                       "activation's derivative")
    if approx.norm is not None:
        reasons.append(f"approx_bp.norm={approx.norm!r} folds the norm weights into the next linear layers, so its "
                       "gradients are of other parameters than the stock model's")
    return "; ".join(reasons) + " (docs/APPROX_BP.md)" if reasons else None


def _verify(argv: list[str], prog: str, launch: Callable[[int, list[str]], int] | None) -> int:
    from ds_longseq.processes.process_group import launcher_environment

    args = build_parser(prog).parse_args(argv)
    _check_args(args)
    long_seq = _long_seq(args.ds_config)
    size = long_seq.sequence_parallel.size
    minimum = min_seq_len(long_seq)  # checked once, before any rank starts
    seq_len = args.seq_len if args.seq_len is not None else default_seq_len(long_seq)
    if seq_len < minimum:
        per_rank = f" per rank x {size} ranks" if size > 1 else ""
        raise SystemExit(f"--seq-len {seq_len} is shorter than two of the config's chunks ({minimum // size} tokens"
                         f"{per_rank} = {minimum}): the chunked paths would not run; pass --seq-len >= {minimum}")
    if size > 1 and seq_len % (2 * size):
        up = math.ceil(seq_len / (2 * size)) * 2 * size
        raise SystemExit(f"--seq-len {seq_len}: sequence parallel {size} cuts each row into {size} shards, in halves "
                         f"when a ring runs: pass a multiple of {2 * size}, e.g. {up}")
    launcher = launcher_environment()
    if size > 1 and launcher is None:
        if launch is None:
            raise SystemExit(f"--ds_config {args.ds_config}: sequence parallel size {size} needs {size} ranks: run "
                             f"`ds-longseq verify`, which starts them, or `deepspeed --num_gpus {size} --module "
                             "ds_longseq.cli verify ...`")
        print(f"{prog}: sequence parallel {size}: starting DeepSpeed's launcher over {size} ranks", file=sys.stderr,
              flush=True)
        return launch(size, argv)
    group, rank = None, 0
    if launcher is not None:
        group, rank = _start_group(size)
    return _check(args, long_seq, seq_len, group, rank)


def _start_group(size: int):
    """DeepSpeed's process group and its sequence-parallel groups; (the group, this rank). The world is one
    sequence's ranks: verify compares one sequence, with no data-parallel replicas."""
    import torch.distributed as dist

    from ds_longseq.engine import sequence_parallel_groups
    from ds_longseq.processes.process_group import ensure_process_group

    ensure_process_group(size)
    world = dist.get_world_size()
    if world != size:
        raise SystemExit(f"{world} ranks started for long_seq.sequence_parallel.size {size}: verify checks one "
                         f"sequence, so launch exactly {size} rank(s) (`ds-longseq verify` starts them itself)")
    if size == 1:
        return None, dist.get_rank()
    return sequence_parallel_groups(size).get_sequence_parallel_group(), dist.get_rank()


def _check(args: argparse.Namespace, long_seq: LongSeqConfig, seq_len: int, group, rank: int) -> int:
    import ds_longseq.patch as patch
    from ds_longseq.toolkit.pretrained import load_config

    dtype_name, dtype = args.dtype, DTYPES[args.dtype]
    size = long_seq.sequence_parallel.size
    _progress(rank, f"[1/5] reading {args.model}'s config and {args.ds_config}")
    config = load_config(args.model)
    if getattr(config, "num_hidden_layers", None) is None:
        raise SystemExit(f"--model {args.model}: its config has no num_hidden_layers (a multimodal or encoder "
                         "model?): pass a causal LM's directory")
    device = _device()
    try:
        num_layers, total, gib = layers_that_fit(config, args.layers, device=device.type)
    except UnsupportedModelError as err:
        raise SystemExit(f"--model {args.model} with --ds_config {args.ds_config}: {err}") from None
    config, dropouts = truncated_config(config, num_layers)
    if args.data:
        batch = data_batch(args.data, args.model, seq_len)
        source = f"the first {BATCH_ROWS} rows of {args.data}"
    else:
        pad = getattr(config, "pad_token_id", None)
        batch = random_batch(config.vocab_size, seq_len, args.seed, pad if isinstance(pad, int) else 0)
        source = f"random tokens (seed {args.seed}), row 1 right-padded with a masked prompt"

    _progress(rank, f"[2/5] ds_longseq run: {num_layers} of {total} layers in {dtype_name}, {seq_len} tokens x "
                    f"{BATCH_ROWS} rows" + (f" over {size} ranks" if size > 1 else "") + f" (~{gib:.1f} GiB)")
    model = load_checkpoint(args.model, config, dtype, args.seed, device)
    norms = float64_throughout(model) if dtype == torch.float64 else []
    try:
        patch.enable(model, long_seq, sp_group=group)
    except (UnsupportedModelError, LongSeqConfigError) as err:
        raise SystemExit(f"--model {args.model} with --ds_config {args.ds_config}: {err}") from None
    local = batch
    if size > 1:
        from ds_longseq.engine import shard_batch

        local = shard_batch(batch, layout=model)  # this rank's tokens, cut by the model's layout
    local = {k: v.to(device) for k, v in local.items()}
    ours = run_model(model, lambda m: m(**local, use_cache=False).loss, group)
    losses = [ours.loss]
    if size > 1:
        import torch.distributed as dist

        losses = [None] * size
        dist.all_gather_object(losses, ours.loss, group=group)
    del model
    gc.collect()
    status = EXIT_EXACT
    if rank == 0:
        batch = {k: v.to(device) for k, v in batch.items()}
        status = _compare(args, config, batch, ours, losses, norms, dropouts, long_seq,
                          (num_layers, total, seq_len, source), device)
    if size > 1:
        import torch.distributed as dist

        verdict = [status]
        dist.broadcast_object_list(verdict, src=0, group=group)  # every rank exits with rank 0's verdict
        status = verdict[0]
    return status


def _device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device())


def _compare(args, config, batch, ours: Result, losses: list[float], norms: list[str], dropouts: list[str],
             long_seq: LongSeqConfig, shape: tuple, device: torch.device) -> int:
    """Rank 0: the stock runs, the differences, the report; returns the exit status."""
    num_layers, total, seq_len, source = shape
    dtype_name, dtype = args.dtype, DTYPES[args.dtype]
    size = long_seq.sequence_parallel.size
    _progress(0, "[3/5] stock run in float64 (the reference)")
    reference_model = load_checkpoint(args.model, config, torch.float64, args.seed, device)
    float64_throughout(reference_model)  # float64 throughout, whatever the checked run's dtype
    reference = run_model(reference_model, lambda m: stock_loss(m, batch))
    del reference_model
    gc.collect()
    stock_errs = None
    if dtype != torch.float64:
        _progress(0, f"[4/5] stock run in {dtype_name} (its own difference from float64: the baseline)")
        stock_model = load_checkpoint(args.model, config, dtype, args.seed, device)
        stock = run_model(stock_model, lambda m: m(**batch, use_cache=False).loss)  # what stock training computes
        del stock_model
        gc.collect()
        stock_errs = relative_errors(stock, reference)
    else:
        _progress(0, "[4/5] no baseline run: float64 is checked against its tolerance outright")
    _progress(0, "[5/5] comparing")
    ours_errs = relative_errors(ours, reference)
    # every rank of a sequence must report the whole sequence's loss: the worst rank counts
    ours_errs["loss"] = max(abs(x - reference.loss) / max(abs(reference.loss), 1e-300) for x in losses)
    tolerance = tolerance_for(dtype_name)
    exact, why = judge(ours_errs, stock_errs, tolerance)
    approximate = _approximate(long_seq)

    layers = f"the first {num_layers} of {total} decoder layers" if num_layers < total else f"all {total} layers"
    print(f"ds-longseq verify: {config.model_type} from {args.model}, {layers} with the real head; {dtype_name}; "
          f"{seq_len} tokens x {BATCH_ROWS} rows of {source}")
    print(f"long_seq: {_describe(long_seq)}" + (f" ({size} ranks against one process)" if size > 1 else ""))
    print("dropout: " + (f"off in both runs ({', '.join(dropouts)}): ds_longseq replays draws from its own "
                         "generators, so masks would differ" if dropouts else "none in the config"))
    if norms:
        print(f"float64 throughout in both runs: {', '.join(norms)} (stock ones round to float32 inside a float64 "
              "model)")
    print(f"loss: stock float64 {reference.loss:.10g}, long_seq {losses[0]:.10g}"
          + (f" (ranks: {', '.join(f'{x:.10g}' for x in losses)})" if size > 1 else "")
          + f", relative difference {ours_errs['loss']:.2e}"
          + (f" (stock {dtype_name}: {stock_errs['loss']:.2e})" if stock_errs else ""))
    print("gradients, worst relative difference per parameter group (norm-wise, against float64 stock)"
          + (f" [stock {dtype_name}'s own]" if stock_errs else "") + ":")
    groups = group_errors(ours, reference)
    width = max(map(len, groups))
    for name, (err, where) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        own = f"  [{stock_errs[name]:.2e}]" if stock_errs and name in stock_errs else ""
        at = f"  ({where})" if where != name else ""
        print(f"  {name:<{width}}  {err:.2e}{own}{at}")
    rule = f"{why}: {tolerance.why}"
    if approximate:
        print(f"verdict: NOT EXACT by design: {approximate}; measured {max(ours_errs.values()):.2e} ({rule})")
        return EXIT_NOT_EXACT
    if exact:
        print(f"verdict: EXACT ({rule})")
        return EXIT_EXACT
    print(f"verdict: NOT EXACT ({rule}); please report it to ds-longseq with this output")
    return EXIT_NOT_EXACT

