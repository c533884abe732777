#!/usr/bin/env bash
# One 10-minute GPU command: tests/gpu (checklist item 1), then ALST's real recipe (DeepSpeed's own
# checkpoint offload, TiledMLP, TiledFusedLogitsLoss, expandable segments) against StreamBP with
# layer-input offload at the Llama-3-8B LoRA shape, 32K (warm-up + 2 timed steps) and 128K (one step).
#
#   bash benchmarks/gpu_real_alst.sh OUT_DIR [NAME=gpu_lora_real_alst]
#   METHODS_32K="hf_gc alst_offload streambp_offload" BUDGET_32K=3.0 bash benchmarks/gpu_real_alst.sh OUT_DIR NAME
#                                      (HF checkpointing beside them at 32K; the 128K pair is unchanged)
#
# Run on the GPU machine in the repo root with the wheelhouse in .whl (launch/build_wheelhouse.sh .whl
# 3.12, without its ds_longseq wheel: the checkout is used; plus transformers 5.24.0's wheel where the
# image's is older). Every stage writes its files as it goes; a stage cut at its budget leaves the others.
set -uo pipefail
OUT=${1:?usage: gpu_real_alst.sh OUT_DIR [NAME]}
NAME=${2:-gpu_lora_real_alst}
METHODS_32K=${METHODS_32K:-alst_offload streambp_offload}
BUDGET_32K=${BUDGET_32K:-2.4}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  free -g | head -2
  python3 -c "import torch, transformers, deepspeed, peft; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| deepspeed', deepspeed.__version__, '| peft', peft.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
start=$SECONDS
DS_LONGSEQ_GPU_REPORT=$OUT/gpu_tests.jsonl timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -n 6 -q -p no:cacheprovider tests/gpu \
  > "$OUT/gpu_tests.txt" 2>&1
echo "tests/gpu rc=$? in $((SECONDS - start)) s"; grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.txt" | head -20
tail -2 "$OUT/gpu_tests.txt"
# shellcheck disable=SC2086  # the method list is words
python3 -m benchmarks.run --suite gpu_lora --methods $METHODS_32K --seq-lens 32768 \
  --warmup 1 --steps 2 --no-search --time-budget-min "$BUDGET_32K" --out "$OUT/$NAME"
python3 -m benchmarks.run --suite gpu_lora --methods alst_offload streambp_offload --no-grid \
  --search-lengths 131072 --time-budget-min 3.7 --append --out "$OUT/$NAME"
echo "all stages done in $((SECONDS - start)) s"
