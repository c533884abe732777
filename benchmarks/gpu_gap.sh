#!/usr/bin/env bash
# Issue 61 item 5: the speed gap to checkpointing and ALST, sized for one 15-minute GPU lease (1-2 minutes of it
# go to the machine's start and the transfers; one command may run 10 minutes). Llama-3-8B LoRA shape
# (benchmarks.run's gpu_lora suite), bf16, one H100 80 GB or H200; every point a fresh process, every row steady
# state (at least one warm-up step before the timed ones, 128K included).
#
#   bash benchmarks/gpu_gap.sh OUT_DIR ab      device command 1, at most 9 min (stage budgets below)
#   bash benchmarks/gpu_gap.sh OUT_DIR c       device command 2, at most 3 min
#   bash benchmarks/gpu_gap.sh OUT_DIR all     ab then c (about 12 min: more than one device command may run)
#   bash benchmarks/gpu_gap.sh OUT_DIR smoke   every stage at a tiny size on the CPU (smoke_lora), no wheels, no
#                                              nvidia-smi; under 2 minutes on a 2-core machine
#
# Stages and their time budgets (caps passed to --time-budget-min / --timeout-s; the expected times are
# ESTIMATES from the H200 rows of 2026-11-28, benchmarks/results/gpu_lora_h200_after_speed.csv: 7.1 s a step for
# hf_gc and 8.6 s for StreamBP + offload at 32K, 64 s (ALST) and 74 s (StreamBP + offload) at 128K cold; plus a
# guess, not measured on its own, of 25 s a point to start a process and build the 8B model on the device):
#   (a) 32K, 1 warm-up + 2 timed steps: hf_gc, streambp_auto, streambp_auto_offload.   cap 3.2 min, est. 2.5
#   (b) 128K, 1 warm-up + 1 timed step: streambp_auto_offload, alst_offload.            cap 8.7 min minus (a)'s
#       time (so at least 5.5), est. 5.4. Ours first: if the budget cuts a point, ALST's is the one with
#       earlier numbers (2043 and 2056 tokens/s, cold single steps, in the CSVs named above).
#   (c) 64K, streambp_auto_offload: 1 warm-up, one phase-timed step (CUDA events at every ds_longseq phase), one
#       profiled step (CUDA activity only, key_averages): benchmarks/phase_profile.py.  cap 2.6 min, est. 2.0
# Wheel install and environment lines: about 15 s (estimate) before each command's stages, outside the caps, so
# command 1 ends within 9 min and command 2 within 3 (run each with the device's timeout_s at 600).
# Each command ends with the combined table (benchmarks/gap_report.py) of what OUT_DIR holds, printed last. The
# second command's OUT_DIR is a fresh $OUT: for one table over both, carry the first command's gap_ab.csv in a
# folder and name it in GAP_PREVIOUS (GAP_PREVIOUS=.gap bash benchmarks/gpu_gap.sh $OUT c), or run
# `python -m benchmarks.gap_report DIR_A DIR_C` afterwards where the files landed (no torch needed).
# Files per command (the device returns at most 8): ab: gap_ab.{csv,md,png}, env_ab.txt, gap_report.{md,csv};
# c: phase_65536.{json,csv,md}, env_c.txt, gap_report.{md,csv}.
#
# Set-up as benchmarks/gpu_real_alst.sh: run in the repo root on the GPU machine with the wheelhouse in .whl
# (launch/build_wheelhouse.sh .whl 3.12, without its ds_longseq wheel: the checkout is used; plus transformers
# 5.24.0's wheel where the image's is older), carried with the call. Every stage writes its files as it goes.
set -uo pipefail
OUT=${1:?usage: gpu_gap.sh OUT_DIR [ab|c|all|smoke]}
STAGE=${2:-all}
case "$STAGE" in ab | c | all | smoke) ;; *) echo "unknown stage '$STAGE': ab, c, all or smoke" >&2; exit 2 ;; esac
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}

if [ "$STAGE" = smoke ]; then
  # the gpu_lora path (PEFT LoRA on a frozen base, torch AdamW) with a tiny Llama in float32 on the CPU
  SUITE=smoke_lora LEN_A=256 LEN_B=512 LEN_C=384
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  SUITE=gpu_lora LEN_A=32768 LEN_B=131072 LEN_C=65536
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
AB_CAP_MIN=8.7 A_CAP_MIN=3.2 B_FLOOR_MIN=5.5 C_TIMEOUT_S=156

{
  date -u
  [ "$STAGE" = smoke ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  free -g | head -2
  # versions from the installed metadata (what sys.path resolves first, /tmp/site included), without the seconds
  # that importing deepspeed costs
  $PY -c "from importlib.metadata import version as v
print(' | '.join(f'{p} {v(p)}' for p in ('torch', 'transformers', 'deepspeed', 'peft')))"
} > "$OUT/env_$STAGE.txt" 2>&1
cat "$OUT/env_$STAGE.txt"
start=$SECONDS

if [ "$STAGE" = ab ] || [ "$STAGE" = all ] || [ "$STAGE" = smoke ]; then
  $PY -m benchmarks.run --suite $SUITE --methods hf_gc streambp_auto streambp_auto_offload --seq-lens $LEN_A \
    --warmup 1 --steps 2 --no-search --time-budget-min $A_CAP_MIN --out "$OUT/gap_ab"
  # (b) gets what (a) left of the command's cap, and never less than its own estimate
  b_min=$(awk -v cap=$AB_CAP_MIN -v used=$((SECONDS - start)) -v floor=$B_FLOOR_MIN \
    'BEGIN { b = cap - used / 60; printf "%.2f", (b > floor ? b : floor) }')
  echo "stage (a) took $((SECONDS - start)) s; stage (b) budget $b_min min"
  $PY -m benchmarks.run --suite $SUITE --methods streambp_auto_offload alst_offload --seq-lens $LEN_B \
    --warmup 1 --steps 1 --no-search --time-budget-min "$b_min" --append --out "$OUT/gap_ab"
  echo "stages (a) and (b) done in $((SECONDS - start)) s"
fi
if [ "$STAGE" = c ] || [ "$STAGE" = all ] || [ "$STAGE" = smoke ]; then
  c_start=$SECONDS
  $PY -m benchmarks.phase_profile --suite $SUITE --method streambp_auto_offload --seq-len $LEN_C --warmup 1 \
    --timeout-s $C_TIMEOUT_S --out "$OUT/phase_$LEN_C"
  echo "stage (c) done in $((SECONDS - c_start)) s"
fi
# GAP_PREVIOUS first: a later folder's row of the same point replaces an earlier one's
# shellcheck disable=SC2086  # GAP_PREVIOUS: folders, as words
$PY -m benchmarks.gap_report ${GAP_PREVIOUS:-} "$OUT" --short-len $LEN_A --long-len $LEN_B --out "$OUT/gap_report"
