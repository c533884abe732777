#!/usr/bin/env bash
# Issue 63 item 1 on a GPU: the Llama-3-8B QLoRA row beside 8B LoRA in bf16 (benchmarks.run's gpu_qlora and
# gpu_lora suites: the same model shape, adapter, lengths and engine; QLoRA's decoder linears 4-bit, nf4 with double
# quantization, bf16 compute). Steady state: 1 warm-up step before the timed ones.
#
#   bash benchmarks/gpu_qlora.sh OUT_DIR bnb     device command 1 (seconds): install the carried bitsandbytes wheel
#                                                into .site_bnb/ (ignored by git, so it stays on the warm machine)
#   bash benchmarks/gpu_qlora.sh OUT_DIR run     device command 2, at most 9 min: 32K tokens/s and peak memory of
#                                                streambp_auto_offload for gpu_lora and gpu_qlora (1 warm-up + 2
#                                                timed steps each, cap 3 min; gpu_lora_at_len.*, gpu_qlora_at_len.*),
#                                                then gpu_qlora's longest length (probes 128K, 192K, 256K, 384K; the
#                                                rest of the 9 min; qlora_maxlen.*)
#   bash benchmarks/gpu_qlora.sh OUT_DIR smoke   both stages' points on the CPU with the tiny smoke_qlora / smoke_lora
#                                                suites (no wheels, no nvidia-smi)
#
# Why two commands: bitsandbytes is not in the GPU machine's image, and its manylinux wheel (~41 MiB) with the
# wheelhouse of benchmarks/gpu_gap.sh (.whl: DeepSpeed, ds_longseq's dependencies, transformers 5.24) would pass
# the 64 MiB one call can carry. So the first call carries .whl_bnb alone, the second .whl (the machine stays warm
# between them and keeps .site_bnb). Prepare both here, with network:
#   bash launch/build_wheelhouse.sh .whl 3.12            (plus transformers 5.24.0's wheel, as for gpu_gap.sh)
#   python -m pip download bitsandbytes==0.50.2 --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_24_x86_64 -d .whl_bnb
# Not run on a GPU yet: the times above are caps, not measurements.
set -uo pipefail
OUT=${1:?usage: gpu_qlora.sh OUT_DIR [bnb|run|smoke]}
STAGE=${2:-run}
case "$STAGE" in bnb | run | smoke) ;; *) echo "unknown stage '$STAGE': bnb, run or smoke" >&2; exit 2 ;; esac
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if [ "$STAGE" = bnb ]; then
  ls .whl_bnb/bitsandbytes-*.whl >/dev/null 2>&1 || { echo "no .whl_bnb/bitsandbytes-*.whl carried" >&2; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target .site_bnb .whl_bnb/bitsandbytes-*.whl || exit 2
  PYTHONPATH=$PWD/.site_bnb $PY -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" \
    | tee "$OUT/env_bnb.txt"
  exit 0
fi

if [ "$STAGE" = smoke ]; then
  LORA=smoke_lora QLORA=smoke_qlora LEN=256 PROBES="512"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  LORA=gpu_lora QLORA=gpu_qlora LEN=32768 PROBES="131072 196608 262144 393216"
  [ -d .site_bnb/bitsandbytes ] || { echo "bitsandbytes not installed here: run the 'bnb' stage first" >&2; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD/.site_bnb:$PWD
fi
{
  date -u
  [ "$STAGE" = smoke ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers, peft, bitsandbytes; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| peft', peft.__version__, '| bitsandbytes', bitsandbytes.__version__)"
} > "$OUT/env_qlora.txt" 2>&1
cat "$OUT/env_qlora.txt"
start=$SECONDS
WARMUP=1 STEPS=2
[ "$STAGE" = smoke ] && WARMUP=0 STEPS=1
for suite in "$LORA" "$QLORA"; do
  $PY -m benchmarks.run --suite "$suite" --methods streambp_auto_offload --seq-lens "$LEN" --warmup $WARMUP \
    --steps $STEPS --no-search --time-budget-min 1.5 --out "$OUT/${suite}_at_len"
done
left=$(( 540 - (SECONDS - start) ))
# shellcheck disable=SC2086  # the probe list is words
$PY -m benchmarks.run --suite "$QLORA" --methods streambp_auto_offload --no-grid --search-lengths $PROBES \
  --time-budget-min "$(awk -v s=$left 'BEGIN { printf "%.1f", (s > 60 ? s : 60) / 60 }')" --out "$OUT/qlora_maxlen"
echo "all stages done in $((SECONDS - start)) s"
