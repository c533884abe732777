"""Memory planner: what one training step needs per GPU and per host, and the longest sequence that fits.

    python -m ds_longseq.plan --model PATH_OR_CONFIG_JSON --ds-config ds_configs/gpu1_zero3_offload_streambp.json \
        --seq-len 393216 --gpu-mem-gib 80 --host-mem-gib 128 [--lora-rank 16] [--gpus 8 --nodes 2]

The planner in three layers, each importing only the ones before it, all torch-free:
``plan_memory`` (the memory model: ``Setup``, ``estimate``, ``plan``, ``preflight``; its module docstring says
what each component counts and where the fitted numbers come from), ``plan_search`` (the step-time model and the
search behind ``--write-config``) and this module, the command line and the planner's public names.

Holds:
    main: the command line (``python -m ds_longseq.plan``, ``ds-longseq plan``): the estimate at a length and what
        would fit, or with ``--write-config`` the fastest setting that fits written as a DeepSpeed config.
    The public names of ``plan_memory`` and ``plan_search`` (``__all__``), so that ``ds_longseq.plan`` is the one
        place callers import the planner from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from dataclasses import replace

from ds_longseq.config_files import ConfigFileError, find_ds_config, read_json_file
from ds_longseq.plan_memory import (
    CHUNK_WORK_SLOPE,
    COEFFICIENTS,
    DISK_STAGING_BYTES,
    GIB,
    HELD_OUT_ERROR,
    METHOD_OF_TECHNIQUE,
    Coefficient,
    Estimate,
    Method,
    ModelDims,
    Plan,
    PreflightError,
    QuantType,
    Setup,
    estimate,
    longest_fit,
    plan,
    preflight,
    quantised_bytes,
    quantised_linears,
    quantised_parts,
    recommend_preset,
    resolve_keep,
    sp_split,
)
from ds_longseq.plan_search import (
    MAX_REFUSED,
    SEARCHED_FIELDS,
    SETTINGS,
    SPEEDS,
    Candidate,
    Speeds,
    StepTime,
    Written,
    choose_config,
    explain,
    search,
    step_time,
    written_config,
)

__all__ = [
    "ModelDims",
    "Method",
    "METHOD_OF_TECHNIQUE",
    "Setup",
    "Coefficient",
    "COEFFICIENTS",
    "HELD_OUT_ERROR",
    "Estimate",
    "Plan",
    "PreflightError",
    "estimate",
    "longest_fit",
    "resolve_keep",
    "sp_split",
    "plan",
    "preflight",
    "QuantType",
    "quantised_linears",
    "quantised_bytes",
    "quantised_parts",
    "Speeds",
    "SPEEDS",
    "StepTime",
    "step_time",
    "Candidate",
    "SETTINGS",
    "search",
    "explain",
    "written_config",
    "Written",
    "choose_config",
    "MAX_REFUSED",
    "SEARCHED_FIELDS",
    "GIB",
    "DISK_STAGING_BYTES",
    "CHUNK_WORK_SLOPE",
    "main",
]


def _load_model_config(path: str) -> dict:
    """The model's config.json as a dict (bad input: ValueError, which main() turns into exit status 2)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigFileError(f"--model {path}: no such directory or config.json (pass a model directory or its "
                              "config.json)")
    return read_json_file(file, "model config")


EXIT_STATUSES = """exit status: 0 the run fits; 1 it does not fit (the report says what would); 2 bad input (an
unreadable or malformed --ds-config or --model config, a missing --model, an invalid value), one line on stderr."""


def main(argv: list[str] | None = None, prog: str = "python -m ds_longseq.plan") -> int:
    """The planner's command line (``python -m ds_longseq.plan``, ``ds-longseq plan``); returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=EXIT_STATUSES)
    p.add_argument("--model", required=True, help="model directory or its config.json")
    p.add_argument("--ds-config", "--ds_config", dest="ds_config",
                   help="DeepSpeed JSON with its long_seq section, a path or a shipped config's name (an existing path "
                        "wins; `ds-longseq configs` lists the names); default: ZeRO-2, StreamBP")
    p.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in all (default 1)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU (default 80)")
    p.add_argument("--host-mem-gib", type=float, default=None, help="memory per host (default: unchecked)")
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--method", choices=typing.get_args(Method), help="override the method the config implies")
    p.add_argument("--load-in-4bit", nargs="?", const="nf4", choices=typing.get_args(QuantType), default=None,
                   help="QLoRA: the decoder layers' linears in 4 bits by bitsandbytes (bare flag: nf4), under a LoRA "
                        "adapter (--lora-rank); as the training scripts' flag")
    p.add_argument("--no-double-quant", dest="double_quant", action="store_false",
                   help="with --load-in-4bit: float32 block scales, not quantised again (default: double quantisation)")
    p.add_argument("--write-config", metavar="PATH",
                   help="search the settings that fit (ZeRO stage, SP size and ring, chunk size, layer-input tier and "
                        "keep_every, optimizer offload, kept attention outputs) and write the DeepSpeed config of the "
                        "fastest to PATH, --ds-config (default: the preset for the launch) the base for the rest")
    p.add_argument("--disk-path", help="with --write-config: the layer inputs may go to files in this directory")
    args = p.parse_args(argv)
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "long_seq": {"streambp": {"enabled": True}}}
    try:
        if args.disk_path and not args.write_config:
            raise ValueError("--disk-path is read with --write-config only: add --write-config PATH, or give the disk "
                             "in the config (long_seq.offload.disk_path)")
        if args.write_config:
            return _write_config(args)
        setup = Setup.from_configs(args.ds_config or ds, device=args.device, gpus=args.gpus, nodes=args.nodes,
                                   lora_rank=args.lora_rank, load_in_4bit=args.load_in_4bit,
                                   double_quant=args.double_quant)
        if args.method:
            setup = replace(setup, method=args.method)
        dims = ModelDims.from_config(_load_model_config(args.model))
        host = None if args.host_mem_gib is None else args.host_mem_gib * GIB
        result = plan(dims, setup, args.seq_len, args.gpu_mem_gib * GIB, host)
    except (ValueError, OSError) as err:
        print(f"ds_longseq.plan: {err}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.fits else 1


def _write_config(args: argparse.Namespace) -> int:
    """``--write-config``: search, report why, write the fastest config that fits (0) or say the nearest (1)."""
    if args.method not in (None, "streambp"):
        raise ValueError(f"--method {args.method} with --write-config: the search writes StreamBP's settings; drop "
                         "--method")
    device = args.device
    base_name = args.ds_config or recommend_preset(Setup(device=device, gpus=args.gpus, nodes=args.nodes))
    base_config = read_json_file(find_ds_config(base_name))
    base = Setup.from_configs(base_config, device=device, gpus=args.gpus, nodes=args.nodes, lora_rank=args.lora_rank,
                              load_in_4bit=args.load_in_4bit, double_quant=args.double_quant)
    if base.method not in ("streambp", "hf_gc"):
        raise ValueError(f"--ds-config {base_name} enables {base.method} (mini_seq): --write-config writes StreamBP's "
                         "settings; disable it there or pass another --ds-config")
    dims = ModelDims.from_config(_load_model_config(args.model))
    host = None if args.host_mem_gib is None else args.host_mem_gib * GIB
    device_bytes = args.gpu_mem_gib * GIB
    written = choose_config(dims, base_config, base, args.seq_len, device_bytes, host, disk_path=args.disk_path)
    print(f"ds_longseq plan --write-config (base: {base_name})")
    print("\n".join(written.lines))
    if written.chosen is None:
        return 1
    with open(args.write_config, "w") as f:
        json.dump(written.config, f, indent=2)
        f.write("\n")
    if base.load_in_4bit:
        print(f"4-bit weights: train with --load-in-4bit {base.load_in_4bit}"
              + ("" if base.double_quant else " --no-double-quant") + f" --lora-rank {base.lora_rank} (the config "
              "carries no quantisation)")
    print(f"wrote {args.write_config} (it passes the resolver for {base.gpus} rank(s) at {args.seq_len:,} tokens)\n")
    print(plan(dims, written.chosen.setup, args.seq_len, device_bytes, host).report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
