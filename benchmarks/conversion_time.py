"""How long DeepSpeed's conversion of a checkpoint to its universal form takes, per billion parameters (on CPU).

    python -m benchmarks.conversion_time --hidden 512 1024 --out benchmarks/results/conversion_time_cpu

A resume on another number of ranks converts the checkpoint once (``deepspeed.checkpoint.ds_to_universal``, run by
global rank 0 while the other ranks wait: ``ds_longseq.engine.reshape.to_universal``). For each width: a Llama-shaped
model (8 layers, vocabulary 32000, float32), one ZeRO-2 AdamW step through DeepSpeed on one CPU rank, its checkpoint
saved, then the conversion timed as ds_longseq runs it (one extract and one merge worker). Reports the parameters,
the checkpoint's bytes and the conversion's seconds, and seconds per billion parameters: what docs/LAUNCHING.md
quotes to size ``DS_LONGSEQ_CONVERSION_TIMEOUT_S`` for a larger model (an extrapolation beyond the sizes measured).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import harness


def measure(spec: dict) -> dict:
    """One width's point (``spec["hidden"]``), in a fresh child process."""
    import deepspeed
    import torch
    import transformers

    hidden, layers, vocab = spec["hidden"], 8, 32000
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1),
                                      vocab_size=vocab, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
                 "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    ids = torch.randint(0, vocab, (1, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag="step1")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(tmp, "step1"))
                   for f in files)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(tmp, "step1"), "--output_folder", os.path.join(tmp, "step1.universal"),
                        "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - start
    return {"hidden": hidden, "params": params, "checkpoint_bytes": size, "seconds": seconds,
            "s_per_billion": seconds / (params / 1e9)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", nargs="+", type=int, default=[512, 1024])
    p.add_argument("--out", default=None, help="output prefix (.md, .jsonl)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child is not None:
        return harness.child_main(measure, args._child)
    rows = [harness.spawn("benchmarks.conversion_time", {"hidden": h}, timeout_s=1800)[0] for h in args.hidden]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        raise SystemExit(f"conversion_time: {failed[0].get('error')}")
    lines = ["# DeepSpeed's universal-checkpoint conversion time on CPU (ds_to_universal, one worker each)", "",
             "| hidden | parameters | checkpoint | conversion s | s per billion parameters |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['hidden']} | {r['params'] / 1e6:.1f} M | {r['checkpoint_bytes'] / 2**20:.0f} MiB | "
              f"{r['seconds']:.1f} | {r['s_per_billion']:.0f} |" for r in rows]
    lines += ["", *harness.environment(["python -m benchmarks.conversion_time " + " ".join(
        f"--hidden {h}" if i == 0 else str(h) for i, h in enumerate(args.hidden))]), ""]
    harness.write_report(args.out, "\n".join(lines), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
