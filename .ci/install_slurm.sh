#!/usr/bin/env bash
# Install, configure and start a real SLURM on this machine for tests/test_slurm.py: munge, slurmctld and two
# slurmd, the nodes node1 (127.0.0.1) and node2 (127.0.0.2), each slurmd in its own UTS namespace (`unshare --uts`,
# as the multi-node tests' sshds) on its own port, so that it and the tasks it starts see their node's hostname:
# Debian's slurm-wlm has no multiple-slurmd support (no `slurmd -N`), but a slurmd takes its node name from the
# hostname, which gives two nodes on one host without it. /etc/hosts gets the two names (tasks rendezvous at
# node1). Where unshare --uts is not permitted (a container without CAP_SYS_ADMIN): one node named after this host.
# Each node has all the CPUs and the partition lets tasks share cores (the tests run 2-rank jobs on 2 cores);
# JobRequeue=1. Debian/Ubuntu packages, so it needs root and apt; without them it says so and exits 0, and those
# tests skip naming this script. Idempotent: a SLURM that already answers is left alone (`scontrol shutdown`
# first to reconfigure). Tested on Debian 12 (slurm-wlm 22.05.8, munge 0.5.15).
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
mkdir -p /run/munge /var/spool/slurmctld /var/log/slurm
chown munge:munge /run/munge
[[ -s /etc/munge/munge.key ]] || { mungekey --create >>"$log" 2>&1 || create-munge-key -f >>"$log" 2>&1; }
pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged >>"$log" 2>&1 || /usr/sbin/munged --force >>"$log" 2>&1

if unshare --uts true 2>/dev/null; then
  nodes=(node1 node2)
  node_lines="NodeName=node1 NodeAddr=127.0.0.1 Port=6818 CPUs=$(nproc) State=UNKNOWN"$'\n'
  node_lines+="NodeName=node2 NodeAddr=127.0.0.2 Port=6819 CPUs=$(nproc) State=UNKNOWN"
  for i in 1 2; do
    grep -qE "^127\.0\.0\.$i[[:space:]]+node$i([[:space:]]|$)" /etc/hosts || echo "127.0.0.$i node$i" >> /etc/hosts
  done
else
  nodes=("$host")
  node_lines="NodeName=$host CPUs=$(nproc) State=UNKNOWN"
fi
for node in "${nodes[@]}"; do mkdir -p "/var/spool/slurmd/$node"; done

cat > /etc/slurm/slurm.conf <<CONF
# written by ds-longseq's .ci/install_slurm.sh: ${nodes[*]} on this host
ClusterName=dslongseq
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

pgrep -x slurmctld >/dev/null || slurmctld >>"$log" 2>&1
for node in "${nodes[@]}"; do
  pid="/run/slurmd-$node.pid"
  if [[ -f $pid ]] && kill -0 "$(cat "$pid")" 2>/dev/null; then continue; fi
  if [[ ${#nodes[@]} -gt 1 ]]; then
    unshare --uts sh -c "hostname $node && exec slurmd" >>"$log" 2>&1
  else
    slurmd >>"$log" 2>&1
  fi
done
for _ in $(seq 30); do
  if [[ $(timeout 5 sinfo -h -o %T 2>/dev/null | grep -cE "idle|mix|alloc") -ge 1 ]] \
      && ! timeout 5 sinfo -h -N -o %T 2>/dev/null | grep -qvE "idle|mix|alloc"; then
    echo "install_slurm.sh: SLURM up ($(sinfo -h -o '%N %T, %c CPUs each' | head -1))"
    rm -f "$log"
    exit 0
  fi
  sleep 1
done
echo "install_slurm.sh: SLURM did not come up (the SLURM tests will skip):" >&2
tail -5 "$log" /var/log/slurm/slurmctld.log /var/log/slurm/slurmd-*.log >&2 || true
rm -f "$log"
exit 0
