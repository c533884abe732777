#!/usr/bin/env bash
# Multi-node training of examples/sft.py with the DeepSpeed launcher and a hostfile.
#
# Usage (on the first node; see launch/hostfile.example for the hostfile and the ssh setup):
#   cp launch/hostfile.example launch/hostfile && $EDITOR launch/hostfile
#   bash launch/multinode.sh [sft.py args...]
#   HOSTFILE=~/hosts MASTER_ADDR=10.0.0.1 NUM_NODES=2 bash launch/multinode.sh --seq-len 32768 --save-dir /shared/run1
#
# Environment (all optional):
#   HOSTFILE      DeepSpeed hostfile, "node1 slots=8" lines (default: launch/hostfile)
#   DS_CONFIG     DeepSpeed config (default: ds_configs/zero3_streambp.json)
#   MASTER_ADDR   address of the rank-0 node that every node can reach (default: the first
#                 host in HOSTFILE)
#   MASTER_PORT   rendezvous port, free on the master node (default: 29500)
#   NUM_NODES     use only the first N hosts of HOSTFILE      (deepspeed --num_nodes)
#   NUM_GPUS      use only the first N GPUs of every node     (deepspeed --num_gpus)
#   LAUNCHER      how deepspeed reaches the nodes: pdsh (default), openmpi, mpich, impi, slurm, ...
#   DS_LAUNCH_ARGS  extra deepspeed launcher flags, word-split (e.g. "--no_ssh_check --ssh_port 2222")
#   DEEPSPEED     the launcher executable (default: deepspeed)
# Every argument is passed through to examples/sft.py (--max-steps, --seq-len, --save-dir, ...).
# For one node only, no hostfile is needed:  deepspeed --num_gpus N examples/sft.py --ds_config ...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$ROOT/launch/hostfile}"
DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero3_streambp.json}"
MASTER_PORT="${MASTER_PORT:-29500}"
DEEPSPEED="${DEEPSPEED:-deepspeed}"

# deepspeed itself falls back to a local run when the hostfile is missing: fail loudly instead.
if [[ ! -f "$HOSTFILE" ]]; then
  echo "multinode.sh: no hostfile at $HOSTFILE (copy launch/hostfile.example and edit it, or set HOSTFILE)" >&2
  exit 2
fi
if ! command -v "$DEEPSPEED" >/dev/null 2>&1; then
  echo "multinode.sh: '$DEEPSPEED' not found on PATH (pip install deepspeed)" >&2
  exit 2
fi
if [[ -z "${MASTER_ADDR:-}" ]]; then
  MASTER_ADDR="$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$HOSTFILE")"
  if [[ -z "$MASTER_ADDR" ]]; then
    echo "multinode.sh: $HOSTFILE lists no host" >&2
    exit 2
  fi
fi

cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
[[ -n "${NUM_NODES:-}" ]] && cmd+=(--num_nodes "$NUM_NODES")
[[ -n "${NUM_GPUS:-}" ]] && cmd+=(--num_gpus "$NUM_GPUS")
[[ -n "${LAUNCHER:-}" ]] && cmd+=(--launcher "$LAUNCHER")
if [[ -n "${DS_LAUNCH_ARGS:-}" ]]; then
  read -r -a extra <<<"$DS_LAUNCH_ARGS"
  cmd+=("${extra[@]}")
fi
cmd+=("$ROOT/examples/sft.py" --ds_config "$DS_CONFIG" "$@")

echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
