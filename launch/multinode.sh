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
#   SSH_PORT      ssh port of the nodes (deepspeed --ssh_port; default: ssh's own, 22 or ~/.ssh/config)
#   DS_LAUNCH_ARGS  extra deepspeed launcher flags, word-split (e.g. "--no_ssh_check")
#   DEEPSPEED     the launcher executable (default: deepspeed)
#   PYTHON        the interpreter whose path every node must have (default: python)
#   PREFLIGHT     1 (default): check every node first (launch/preflight.py: ssh without a prompt, same
#                 paths, same Python/torch/deepspeed/ds_longseq, slots vs GPUs and NUM_GPUS, the master
#                 address and a free MASTER_PORT), and stop before training, naming the node, on any
#                 problem; "only": check and exit (0 when all is well); 0: skip the check
#
# On failure: when a rank or a node dies, the ds_longseq watchdog (long_seq.watchdog) names the rank
# and every node's ranks exit (a rank dies with its node's launcher); `latest` in --save-dir only
# ever names a checkpoint every rank finished writing, so rerun the same command with --resume.
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

PREFLIGHT="${PREFLIGHT:-1}"
if [[ "$PREFLIGHT" != 0 ]]; then
  check=("${PYTHON:-python}" "$ROOT/launch/preflight.py" --hostfile "$HOSTFILE" --master-addr "$MASTER_ADDR"
         --master-port "$MASTER_PORT")
  [[ -n "${NUM_NODES:-}" ]] && check+=(--num-nodes "$NUM_NODES")
  [[ -n "${NUM_GPUS:-}" ]] && check+=(--num-gpus "$NUM_GPUS")
  [[ -n "${SSH_PORT:-}" ]] && check+=(--ssh-port "$SSH_PORT")
  "${check[@]}" || { echo "multinode.sh: preflight failed (fix the above, or PREFLIGHT=0 to skip it)" >&2; exit 2; }
  [[ "$PREFLIGHT" == only ]] && exit 0
fi

cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
[[ -n "${SSH_PORT:-}" ]] && cmd+=(--ssh_port "$SSH_PORT")
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
