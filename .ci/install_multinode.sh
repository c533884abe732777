#!/usr/bin/env bash
# Install what tests/test_multinode.py needs to run two "nodes" on this machine: an ssh server and client,
# pdsh (the DeepSpeed launcher's default way to reach nodes), Open MPI (launch/mpirun.sh's second
# flavour) and unshare (util-linux: each node gets its own hostname). Debian/Ubuntu packages, so it
# needs root and apt; without them it says so and exits 0, and those tests skip naming this script.
# Idempotent and quiet: one line unless something fails. Tested on Debian 12 (openssh 9.2, pdsh 2.34,
# Open MPI 4.1.4).
#
# Usage: bash .ci/install_multinode.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

need=()
command -v sshd >/dev/null 2>&1 || [[ -x /usr/sbin/sshd ]] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v mpirun.openmpi >/dev/null 2>&1 || need+=(openmpi-bin)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)

if [[ ${#need[@]} -eq 0 ]]; then
  echo "install_multinode.sh: sshd, ssh, pdsh, mpirun.openmpi and unshare present"
  exit 0
fi
if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_multinode.sh: cannot install ${need[*]} (needs root and apt-get): the multi-node tests will skip" >&2
  exit 0
fi
apt_install install_multinode.sh "the multi-node tests will skip" "${need[@]}" || exit 0
echo "install_multinode.sh: installed ${need[*]}"
