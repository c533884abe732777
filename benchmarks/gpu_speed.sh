#!/usr/bin/env bash
# The speed issue's GPU script (issue 40, item 4): one command, about 8 minutes on one H100 or H200.
# Llama-3-8B LoRA shape (benchmarks.run's gpu_lora suite), bf16, one GPU, every point in a fresh process:
#   16K, 32K   StreamBP against HF checkpointing             (1 warm-up + 2 timed steps)
#   32K        StreamBP + offload against the real ALST      (DeepSpeed's checkpoint offload, TiledMLP, tiled loss)
#   128K       StreamBP + offload against the real ALST      (1 warm-up + 1 timed step: two would take ~7 minutes)
# then, as a second command (STAGE=profile: more than 4 minutes, cut at 255 s on an H200 on 2026-11-28; give it a command of its own), the per-phase profile of one StreamBP + offload step
# at 128K (benchmarks/profile.py; no unprofiled or FLOP-counting step at that length), and as a third
# (STAGE=onecall, ~3 minutes) StreamBP + offload with one attention call per chunk (attention.single_call: true,
# FlashAttention-2's bottom-right mask) against the default tiles (cuDNN on an H100 / H200) at 32K and 64K.
#
#   bash benchmarks/gpu_speed.sh OUT_DIR [speed|profile|onecall]
#
# Run tests/gpu first (benchmarks/gpu_real_alst.sh's first stage, or the checklist's command). Set-up as
# benchmarks/gpu_real_alst.sh: the wheelhouse in .whl (launch/build_wheelhouse.sh .whl 3.12). Every stage
# writes its files as it goes, and each has a time budget, so a cut stage leaves the others' numbers.
set -uo pipefail
OUT=${1:?usage: gpu_speed.sh OUT_DIR [speed|profile|onecall]}
STAGE=${2:-speed}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, deepspeed, peft; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| deepspeed', deepspeed.__version__, '| peft', peft.__version__)"
} > "$OUT/env_$STAGE.txt" 2>&1
cat "$OUT/env_$STAGE.txt"
start=$SECONDS
if [ "$STAGE" = speed ]; then
  python3 -m benchmarks.run --suite gpu_lora --methods hf_gc streambp --seq-lens 16384 32768 \
    --warmup 1 --steps 2 --no-search --time-budget-min 2.5 --out "$OUT/gpu_speed_gc"
  python3 -m benchmarks.run --suite gpu_lora --methods alst_offload streambp_offload --seq-lens 32768 \
    --warmup 1 --steps 2 --no-search --time-budget-min 1.5 --out "$OUT/gpu_speed_alst"
  python3 -m benchmarks.run --suite gpu_lora --methods alst_offload streambp_offload --seq-lens 131072 \
    --warmup 1 --steps 1 --no-search --time-budget-min 4.5 --append --out "$OUT/gpu_speed_alst"
elif [ "$STAGE" = onecall ]; then
  python3 -m benchmarks.run --suite gpu_lora --methods streambp_offload streambp_offload_1call \
    --seq-lens 32768 65536 --warmup 1 --steps 2 --no-search --time-budget-min 3 --out "$OUT/gpu_onecall"
else
  python3 -m benchmarks.profile --suite gpu_lora --methods streambp_offload --seq-lens 131072 --no-plain \
    --no-flops --out "$OUT/gpu_profile_128k"
fi
echo "stage $STAGE done in $((SECONDS - start)) s"
