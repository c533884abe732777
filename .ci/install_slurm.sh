#!/usr/bin/env bash
# Install, configure and start a real SLURM on this machine for tests/test_slurm.py: munge, slurmctld and one
# slurmd (Debian's slurm-wlm; its build has no multiple-slurmd support, so one node with several tasks), the node
# named after this host with all its CPUs, a default partition that lets tasks share cores (the tests run 2-rank
# jobs on 2 cores) and JobRequeue=1. Debian/Ubuntu packages, so it needs root and apt; without them it says so and
# exits 0, and those tests skip naming this script. Idempotent: a SLURM that already answers is left alone. Tested
# on Debian 12 (slurm-wlm 22.05.8, munge 0.5.15).
#
# Usage: bash .ci/install_slurm.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

if command -v sinfo >/dev/null 2>&1 && timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
  echo "install_slurm.sh: SLURM answers ($(sinfo -h -o '%N %T' | head -1))"
  exit 0
fi
if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm.sh: cannot install or start SLURM (needs root and apt-get): the SLURM tests will skip" >&2
  exit 0
fi
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  apt_install install_slurm.sh "the SLURM tests will skip" slurm-wlm munge || exit 0
fi
log="$(mktemp)"

host="$(hostname)"
mkdir -p /run/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
chown munge:munge /run/munge
[[ -s /etc/munge/munge.key ]] || { mungekey --create >>"$log" 2>&1 || create-munge-key -f >>"$log" 2>&1; }
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged >>"$log" 2>&1 || /usr/sbin/munged --force >>"$log" 2>&1
cat > /etc/slurm/slurm.conf <<EOF
# written by ds-longseq's .ci/install_slurm.sh: one node, this host
ClusterName=dslongseq
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
pgrep -x slurmctld >/dev/null || slurmctld >>"$log" 2>&1
pgrep -x slurmd >/dev/null || slurmd >>"$log" 2>&1
for _ in $(seq 30); do
  if timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
    echo "install_slurm.sh: SLURM up ($(sinfo -h -o '%N %T %c CPUs' | head -1))"
    rm -f "$log"
    exit 0
  fi
  sleep 1
done
echo "install_slurm.sh: SLURM did not come up (the SLURM tests will skip):" >&2
tail -5 "$log" /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
rm -f "$log"
exit 0
