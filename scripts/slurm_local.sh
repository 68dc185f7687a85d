#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for running the repository's sbatch job for
# real: munged, slurmctld and slurmd from Debian's packages (slurm-wlm, munge), every
# file of theirs (config, key, sockets, state, logs) in one directory.
#
#   scripts/slurm_local.sh start [DIR]    # prints the SLURM_CONF to export
#   scripts/slurm_local.sh stop [DIR]
#   scripts/slurm_local.sh status [DIR]
#   scripts/slurm_local.sh install        # apt-get install slurm-wlm munge (root)
#
# DIR defaults to $HYBRIDREC_SLURM_DIR, else /tmp/hybridrec-slurm. The node offers
# $HYBRIDREC_SLURM_CPUS CPUs (default: the larger of this machine's count and 8: the
# job's tasks share the cores, as oversubscribed tasks do on any node) and listens on
# $HYBRIDREC_SLURM_PORT and the next port (default 6817, 6818). The daemons run as root
# (slurmd starts job steps as the submitting user), so starting needs root; without it,
# or without the packages, this says so and exits 2 with nothing started.
set -euo pipefail

command=${1:-}
dir=$(realpath -m "${2:-${HYBRIDREC_SLURM_DIR:-/tmp/hybridrec-slurm}}")
conf="$dir/slurm.conf"

fail() { echo "slurm_local.sh: $*" >&2; exit 2; }

check_installed() {
  local missing=()
  for binary in munged mungekey slurmctld slurmd sbatch srun scontrol; do
    command -v "$binary" >/dev/null || missing+=("$binary")
  done
  if ((${#missing[@]})); then
    fail "not installed: ${missing[*]} (Debian: apt-get install slurm-wlm munge; or: $0 install)"
  fi
}

daemon_pid() {  # the pid in file $1 if that process is alive
  [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null && cat "$1"
}

start() {
  [[ $(id -u) == 0 ]] || fail "starting Slurm needs root (slurmd runs job steps as their user); run as root or use a cluster's Slurm"
  check_installed
  if daemon_pid "$dir/slurmctld.pid" >/dev/null; then
    fail "a cluster is already running from $dir (stop it: $0 stop $dir)"
  fi
  local host cpus memory port
  host=$(hostname -s)
  getent hosts "$host" >/dev/null || fail "this machine's host name $host does not resolve (add it to /etc/hosts)"
  cpus=${HYBRIDREC_SLURM_CPUS:-$(( $(nproc) > 8 ? $(nproc) : 8 ))}
  memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  port=${HYBRIDREC_SLURM_PORT:-6817}
  rm -rf "$dir"
  mkdir -p "$dir"/{munge,state,spool,log}
  chmod 700 "$dir/munge"
  mungekey --create --keyfile "$dir/munge/munge.key" --force
  chmod 600 "$dir/munge/munge.key"
  munged --force --socket "$dir/munge/munge.socket" --key-file "$dir/munge/munge.key" \
    --pid-file "$dir/munge/munged.pid" --log-file "$dir/log/munged.log" \
    --seed-file "$dir/munge/munged.seed" \
    || fail "munged did not start: $(tail -n 3 "$dir/log/munged.log" 2>/dev/null)"
  cat >"$conf" <<EOF
# written by scripts/slurm_local.sh: a one-node cluster for tests and trials
ClusterName=hybridrec-local
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  SLURM_CONF=$conf slurmctld -f "$conf" || fail "slurmctld did not start: $(tail -n 3 "$dir/log/slurmctld.log")"
  SLURM_CONF=$conf slurmd -f "$conf" || fail "slurmd did not start: $(tail -n 3 "$dir/log/slurmd.log")"
  local deadline=$((SECONDS + 60))
  until SLURM_CONF=$conf sinfo --noheader --states=idle --format=%n 2>/dev/null | grep -q .; do
    if ((SECONDS > deadline)); then
      stop >/dev/null 2>&1 || true
      fail "the node did not become idle in 60 s; see $dir/log"
    fi
    sleep 0.5
  done
  echo "slurm_local.sh: one-node cluster up ($host, $cpus CPUs, partition local); files in $dir" >&2
  echo "export SLURM_CONF=$conf"
}

stop() {
  local stopped=0 pid
  for name in slurmd slurmctld munge/munged; do
    if pid=$(daemon_pid "$dir/$name.pid"); then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      stopped=$((stopped + 1))
    fi
  done
  # job steps left behind by a stopped slurmd
  pkill -9 -f "slurmstepd.*$dir" 2>/dev/null || true
  echo "slurm_local.sh: stopped $stopped daemon(s) of $dir" >&2
}

status() {
  for name in munge/munged slurmctld slurmd; do
    if pid=$(daemon_pid "$dir/$name.pid"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; fi
  done
  [[ -f $conf ]] && SLURM_CONF=$conf sinfo 2>&1 || true
}

case $command in
  start) start ;;
  stop) stop ;;
  status) status ;;
  install)
    [[ $(id -u) == 0 ]] || fail "installing packages needs root"
    command -v apt-get >/dev/null || fail "no apt-get here: install Slurm and MUNGE with this system's package manager"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    check_installed
    echo "slurm_local.sh: slurm-wlm and munge installed" >&2
    ;;
  *) fail "usage: $0 start|stop|status [DIR] | install" ;;
esac
