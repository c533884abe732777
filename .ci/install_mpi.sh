#!/usr/bin/env bash
# Install an MPI launcher (mpirun/mpiexec) and mpi4py from PyPI only, for launch/mpirun.sh and
# tests/test_launch.py. Idempotent: pip leaves satisfied requirements alone, so a second run
# only re-checks. Quiet: prints one line unless something fails.
#
#   mpich   MPICH's Hydra mpirun/mpiexec and libmpi.so.12, installed into the interpreter's
#           prefix (<prefix>/bin/mpirun, <prefix>/lib/libmpi.so.12)
#   mpi4py  binary wheel (4.x) that dlopens an MPI library at import time and finds the mpich
#           package's libmpi in the same prefix: no compiler, no system MPI needed
# Minimum versions are the ones tested (mpich 5.0.2, mpi4py 4.1.2 on CPython 3.11, x86_64).
#
# Usage: bash .ci/install_mpi.sh          (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail

PYTHON="${PYTHON:-python}"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  "mpich>=5.0.2" "mpi4py>=4.1.2"

# The mpirun that matches the installed libmpi sits next to this interpreter.
BIN="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
MPIRUN="$BIN/mpirun"
if [[ ! -x "$MPIRUN" ]]; then
  MPIRUN="$(command -v mpirun)" || { echo "install_mpi.sh: no mpirun after pip install mpich" >&2; exit 1; }
fi

# Check that mpi4py really talks to this mpirun's MPI: 2 ranks must see a world of 2.
out="$(timeout 120 "$MPIRUN" -np 2 "$PYTHON" -c '
from mpi4py import MPI
c = MPI.COMM_WORLD
assert c.Get_size() == 2, f"world size {c.Get_size()}: mpi4py is not using the MPI of this mpirun"
if c.Get_rank() == 0:
    print(" ".join(MPI.Get_library_version().split()[:3]), "| mpi4py", __import__("mpi4py").__version__)
' 2>&1)" || { echo "install_mpi.sh: '$MPIRUN -np 2' with mpi4py failed:" >&2; echo "$out" >&2; exit 1; }
echo "install_mpi.sh: $MPIRUN ok: $out"
