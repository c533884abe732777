#!/usr/bin/env bash
# Launch examples/sft.py with mpirun instead of the deepspeed launcher.
#
# Usage:
#   bash launch/mpirun.sh [sft.py args...]                          # NP=2 ranks on this machine
#   NP=4 bash launch/mpirun.sh --max-steps 10 --save-dir /tmp/run
#   HOSTFILE=launch/hostfile bash launch/mpirun.sh --seq-len 32768   # NP = sum of the slots
# Needs mpirun and mpi4py (from PyPI: bash .ci/install_mpi.sh, i.e. pip install mpich mpi4py).
#
# Environment (all optional):
#   NP            number of ranks (default: the sum of slots= in HOSTFILE, else 2)
#   HOSTFILE      DeepSpeed-style hostfile ("node1 slots=8", see launch/hostfile.example);
#                 turned into MPICH's "node1:8" form when mpirun is MPICH's (Hydra)
#   DS_CONFIG     DeepSpeed config (default: ds_configs/zero2_streambp.json)
#   MPIRUN        the mpirun executable (default: mpirun); PYTHON (default: python)
#   MPI_ARGS      extra mpirun flags, word-split (e.g. "-ppn 8" or "--bind-to none")
#   MPI_DISCOVERY how each rank learns RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR:
#     mpi4py (default)  DeepSpeed's own discovery: sft.py calls
#                       deepspeed.init_distributed(auto_mpi_discovery=True), which (with RANK etc.
#                       unset) asks mpi4py for rank/size, takes rank 0's `hostname -I` as
#                       MASTER_ADDR and sets MASTER_PORT to init_distributed's distributed_port,
#                       29500 unless the caller passes another: a MASTER_PORT set here does not
#                       reach it, so two such jobs on one machine collide.
#     env               this script maps the launcher's per-rank variables (MPICH/Intel MPI:
#                       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID; Open MPI: OMPI_COMM_WORLD_*) to
#                       RANK/WORLD_SIZE/LOCAL_RANK and exports MASTER_ADDR (default: the first
#                       host of HOSTFILE, else 127.0.0.1) and MASTER_PORT (default: 29500), so
#                       DeepSpeed skips discovery (what `deepspeed --launcher mpich` does too).
# Every argument is passed through to examples/sft.py.
#
# Ranks run as `python -u -m mpi4py examples/sft.py`: an uncaught exception on one rank then
# calls MPI_Abort and ends the whole job, where plain `python` would leave the other ranks
# waiting in a collective (or in MPI_Finalize) until a timeout.
#
# MPICH (Hydra) forwards the whole environment to every rank and accepts -genv NAME VALUE,
# -ppn N (ranks per node), -hosts a,b and -f/-hostfile FILE ("host:N" lines).
# Open MPI is detected from `mpirun --version`; the script then passes the DeepSpeed hostfile as
# it is (same "host slots=N" format), adds --allow-run-as-root when run as root and forwards the
# variables the ranks need with -x NAME (Open MPI does not forward the environment to remote
# nodes). Other Open MPI flags worth knowing, for MPI_ARGS: --map-by ppr:8:node (ranks per
# node), --bind-to none (let torch use all cores of a rank), --mca btl_tcp_if_include eth0 (the
# NIC to use), --oversubscribe (more ranks than cores/slots), -x NCCL_DEBUG=INFO.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_streambp.json}"
MPIRUN="${MPIRUN:-mpirun}"
PYTHON="${PYTHON:-python}"
MPI_DISCOVERY="${MPI_DISCOVERY:-mpi4py}"
HOSTFILE="${HOSTFILE:-}"

die() { echo "mpirun.sh: $*" >&2; exit 2; }

command -v "$MPIRUN" >/dev/null 2>&1 || die "'$MPIRUN' not found (bash .ci/install_mpi.sh installs MPICH's from PyPI)"
have_mpi4py=0
"$PYTHON" -c "import mpi4py" >/dev/null 2>&1 && have_mpi4py=1
case "$MPI_DISCOVERY" in
  mpi4py) [[ $have_mpi4py == 1 ]] || die "mpi4py is not importable by $PYTHON (bash .ci/install_mpi.sh)" ;;
  env) ;;
  *) die "MPI_DISCOVERY must be mpi4py or env, not '$MPI_DISCOVERY'" ;;
esac

flavour=mpich
if "$MPIRUN" --version 2>&1 | grep -qiE "open ?mpi|open ?rte"; then
  flavour=openmpi
fi

args=()
tmp_hostfile=""
trap 'if [[ -n "$tmp_hostfile" ]]; then rm -f "$tmp_hostfile"; fi' EXIT
if [[ -n "$HOSTFILE" ]]; then
  [[ -f "$HOSTFILE" ]] || die "no hostfile at $HOSTFILE"
  # "host slots=N" lines, as DeepSpeed reads them: comments and blank lines skipped.
  hosts="$(awk '!/^[[:space:]]*(#|$)/ {n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); print $1, n}' "$HOSTFILE")"
  [[ -n "$hosts" ]] || die "$HOSTFILE lists no host"
  NP="${NP:-$(awk '{s += $2} END {print s}' <<<"$hosts")}"
  first_host="$(awk 'NR == 1 {print $1}' <<<"$hosts")"
  if [[ $flavour == mpich ]]; then
    tmp_hostfile="$(mktemp "${TMPDIR:-/tmp}/mpich_hosts.XXXXXX")"
    awk '{print $1 ":" $2}' <<<"$hosts" >"$tmp_hostfile"
    args+=(-hostfile "$tmp_hostfile")
  else
    args+=(-hostfile "$HOSTFILE")
  fi
fi
NP="${NP:-2}"
args=(-np "$NP" "${args[@]}")

rank_cmd=("$PYTHON" -u)
[[ $have_mpi4py == 1 ]] && rank_cmd+=(-m mpi4py)
rank_cmd+=("$ROOT/examples/sft.py" --ds_config "$DS_CONFIG" "$@")

if [[ $MPI_DISCOVERY == env ]]; then
  export MASTER_ADDR="${MASTER_ADDR:-${first_host:-127.0.0.1}}" MASTER_PORT="${MASTER_PORT:-29500}"
  # Runs on every rank: the launcher's rank variables -> the ones torch/DeepSpeed read.
  # shellcheck disable=SC2016
  shim='export RANK="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:?no MPI rank variable}}}"
export WORLD_SIZE="${PMI_SIZE:-${OMPI_COMM_WORLD_SIZE:?no MPI size variable}}"
export LOCAL_RANK="${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${PALS_LOCAL_RANKID:?no MPI local rank variable}}}"
exec "$@"'
  rank_cmd=(bash -c "$shim" sft-rank "${rank_cmd[@]}")
fi

if [[ $flavour == openmpi ]]; then
  [[ $EUID == 0 ]] && args+=(--allow-run-as-root)
  for name in MASTER_ADDR MASTER_PORT PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS VIRTUAL_ENV HF_HOME; do
    [[ -n "${!name:-}" ]] && args+=(-x "$name")
  done
fi
if [[ -n "${MPI_ARGS:-}" ]]; then
  read -r -a extra <<<"$MPI_ARGS"
  args+=("${extra[@]}")
fi

echo "+ $MPIRUN ${args[*]} ${rank_cmd[*]: -$(( $# + 4 ))}" >&2
"$MPIRUN" "${args[@]}" "${rank_cmd[@]}"
