#!/usr/bin/env bash
# Runs a hybridrec command as N processes on this machine (coordinator on 127.0.0.1,
# each process with its own CPU devices, gloo collectives). Sets up .venv/ first.
#   scripts/launch_local.sh 2 train --data runs/quickstart/data --run-dir runs/two --config quickstart
# DEVICES_PER_PROCESS (default 8 / N) sets the CPU devices of each process.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 N <hybridrec command> [args...]" >&2
  exit 2
fi
n="$1"; shift
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec hybridrec launch --num-processes "$n" --devices-per-process "${DEVICES_PER_PROCESS:-0}" -- "$@"
