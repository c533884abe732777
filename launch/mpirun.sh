#!/usr/bin/env bash
# Launch examples/sft.py, or any training script, with mpirun instead of the deepspeed launcher.
#
# Usage:
#   bash launch/mpirun.sh [sft.py args...]                          # NP=2 ranks on this machine
#   NP=4 bash launch/mpirun.sh --max-steps 10 --save-dir /tmp/run
#   HOSTFILE=launch/hostfile bash launch/mpirun.sh --seq-len 32768   # NP = sum of the slots
#   SCRIPT=train.py bash launch/mpirun.sh [train.py args...]         # your script (Trainer, TRL, your loop)
# Needs mpirun and mpi4py (from PyPI: bash .ci/install_mpi.sh, i.e. pip install mpich mpi4py).
#
# Environment (all optional):
#   NP            number of ranks (default: the sum of slots= in HOSTFILE, else 2)
#   HOSTFILE      DeepSpeed-style hostfile ("node1 slots=8", see launch/hostfile.example);
#                 turned into MPICH's "node1:8" form when mpirun is MPICH's (Hydra)
#   SCRIPT        the script every rank runs (default: examples/sft.py); its arguments are this script's
#   DS_CONFIG     DeepSpeed config for examples/sft.py (default: ds_configs/zero2_streambp.json; passed to
#                 sft.py only: give your own script its config in its own arguments)
#   MPIRUN        the mpirun executable (default: mpirun); PYTHON (default: python)
#   MPI_ARGS      extra mpirun flags, word-split (e.g. "-ppn 8" or "--bind-to none")
#   MASTER_PORT   rendezvous port (see "Rank discovery" below for when it is honoured)
# Every argument is passed through to the script.
#
# Rank discovery: every rank runs `python -m ds_longseq.processes.mpi_env SCRIPT args`, which asks
# mpi4py for the rank and world size, counts the ranks on the same host (LOCAL_RANK,
# LOCAL_WORLD_SIZE), broadcasts rank 0's first `hostname -I` address as MASTER_ADDR (unless
# MASTER_ADDR is set) and takes MASTER_PORT from the environment (29500 if unset), sets them as
# torchrun would, then runs the script. So an unmodified Hugging Face Trainer / TRL script runs
# here as under the deepspeed launcher (accelerate reads LOCAL_RANK and MASTER_ADDR when
# TrainingArguments is made: a bare mpirun trains every GPU rank alone, on GPU 0, and fails on CPU
# ranks for want of MASTER_ADDR). Two mpirun jobs on one machine need different MASTER_PORTs. On a
# node with several networks, check that rank 0's first `hostname -I` address is one the other
# nodes reach, or set MASTER_ADDR.
#
# Ranks run as `python -u -m mpi4py -m ds_longseq.processes.mpi_env SCRIPT`: an uncaught exception on
# one rank then calls MPI_Abort and ends the whole job, where plain `python` would leave the other
# ranks waiting in a collective (or in MPI_Finalize) until a timeout.
#
# MPICH (Hydra) forwards the whole environment to every rank and accepts -genv NAME VALUE,
# -ppn N (ranks per node), -hosts a,b and -f/-hostfile FILE ("host:N" lines).
# Open MPI is detected from `mpirun --version`; the script then passes the DeepSpeed hostfile as
# it is (same "host slots=N" format), adds --allow-run-as-root when run as root, points mpi4py at
# Open MPI's libmpi.so.40 (MPI4PY_LIBMPI, unless set) and forwards the variables the ranks need
# with -x NAME (Open MPI does not forward the environment to remote nodes). Tested with Debian's
# openmpi-bin 4.1.4 (MPIRUN=mpirun.openmpi; .ci/install_multinode.sh installs it). Other Open MPI flags worth knowing, for MPI_ARGS: --map-by ppr:8:node (ranks per
# node), --bind-to none (let torch use all cores of a rank), --mca btl_tcp_if_include eth0 (the
# NIC to use), --oversubscribe (more ranks than cores/slots), -x NCCL_DEBUG=INFO.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DS_CONFIG="${DS_CONFIG:-$ROOT/ds_configs/zero2_streambp.json}"
MPIRUN="${MPIRUN:-mpirun}"
PYTHON="${PYTHON:-python}"
HOSTFILE="${HOSTFILE:-}"

die() { echo "mpirun.sh: $*" >&2; exit 2; }

command -v "$MPIRUN" >/dev/null 2>&1 || die "'$MPIRUN' not found (bash .ci/install_mpi.sh installs MPICH's from PyPI)"
# DeepSpeed's discovery needs mpi4py, built for (or ABI-compatible with) this mpirun's MPI.
"$PYTHON" -c "import mpi4py" >/dev/null 2>&1 || die "mpi4py is not importable by $PYTHON (bash .ci/install_mpi.sh)"

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
  hosts="$(awk '!/^[[:space:]]*(#|$)/ {
    n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); print $1, n
  }' "$HOSTFILE")"
  [[ -n "$hosts" ]] || die "$HOSTFILE lists no host"
  NP="${NP:-$(awk '{s += $2} END {print s}' <<<"$hosts")}"
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

SCRIPT="${SCRIPT:-$ROOT/examples/sft.py}"
[[ -f "$SCRIPT" ]] || die "no script at $SCRIPT"
script_args=("$@")
if [[ "$(readlink -f "$SCRIPT")" == "$(readlink -f "$ROOT/examples/sft.py")" ]]; then
  script_args=(--ds_config "$DS_CONFIG" "$@")
fi
rank_cmd=("$PYTHON" -u -m mpi4py -m ds_longseq.processes.mpi_env "$SCRIPT" "${script_args[@]}")

if [[ $flavour == openmpi ]]; then
  [[ $EUID == 0 ]] && args+=(--allow-run-as-root)
  # mpi4py's PyPI wheel loads the first libmpi it finds, MPICH's (libmpi.so.12, from `pip install mpich`)
  # when both are there, which then aborts under Open MPI's launcher ("unsupported PMI version PMIx"):
  # point it at this mpirun's own libmpi.so.40 (MPI4PY_LIBMPI, honoured by mpi4py >= 4).
  if [[ -z "${MPI4PY_LIBMPI:-}" ]]; then
    bindir="$(dirname "$(readlink -f "$(command -v "$MPIRUN")")")"
    libdir="$("$bindir/ompi_info" --path libdir 2>/dev/null | awk '{print $NF}')" || libdir=""
    # Its own prefix first (a source build in /opt/openmpi: lib/), then Debian's layout (libdir is
    # .../openmpi/lib, the library two levels up), then the linker cache.
    for candidate in "$bindir/../lib" "$bindir/../lib64" "$libdir" "$libdir/../.." \
                     "$(ldconfig -p 2>/dev/null | awk '/libmpi\.so\.40 /{print $NF; exit}' | xargs -r dirname)"; do
      if [[ -n "$candidate" && -e "$candidate/libmpi.so.40" ]]; then
        export MPI4PY_LIBMPI="$(cd "$candidate" && pwd)/libmpi.so.40"
        break
      fi
    done
    [[ -n "${MPI4PY_LIBMPI:-}" ]] || die "Open MPI's libmpi.so.40 not found next to $MPIRUN: set MPI4PY_LIBMPI to it"
  fi
  for name in MASTER_ADDR MASTER_PORT PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS VIRTUAL_ENV HF_HOME MPI4PY_LIBMPI; do
    [[ -n "${!name:-}" ]] && args+=(-x "$name")
  done
fi
if [[ -n "${MPI_ARGS:-}" ]]; then
  read -r -a extra <<<"$MPI_ARGS"
  args+=("${extra[@]}")
fi

echo "+ $MPIRUN ${args[*]} ${rank_cmd[*]}" >&2
"$MPIRUN" "${args[@]}" "${rank_cmd[@]}"
