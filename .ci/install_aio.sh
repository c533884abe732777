#!/usr/bin/env bash
# Install what long_seq.offload.layer_inputs="disk" needs (libaio's headers, Debian/Ubuntu's libaio-dev) and build
# DeepSpeed's async_io op once, so the disk-tier tests (tests/test_disk_offload.py) find it built (~3 minutes on
# 2 cores the first time; then cached in torch's extension directory, ~/.cache/torch_extensions). Installing
# needs root and apt-get; without them it says so and exits 0, and those tests skip naming this script.
# Idempotent: one line unless something fails. Tested on Debian 12 (libaio 0.3.113, DeepSpeed 0.19.8).
#
# Usage: bash .ci/install_aio.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

if [[ ! -e /usr/include/libaio.h ]]; then
  if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_aio.sh: cannot install libaio-dev (needs root and apt-get): the disk-tier tests will skip" >&2
    exit 0
  fi
  apt_install install_aio.sh "the disk-tier tests will skip" libaio-dev || exit 0
fi
start=$SECONDS
if ! python -c "from ds_longseq.ops.disk_store import load_async_io; load_async_io()" >/tmp/install_aio.log 2>&1; then
  echo "install_aio.sh: building DeepSpeed's async_io op failed (the disk-tier tests will fail):" >&2
  tail -5 /tmp/install_aio.log >&2
  exit 1
fi
echo "install_aio.sh: libaio-dev present, DeepSpeed's async_io op built or cached ($((SECONDS - start)) s)"
