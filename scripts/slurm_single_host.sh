#!/usr/bin/env bash
# A one-host SLURM cluster (slurmctld + slurmd on this machine, munge for authentication) for
# trying the examples/slurm batch scripts and for the test that runs them. Needs root and
# Debian's slurm-wlm and munge (scripts/setup.sh installs both).
#
#   scripts/slurm_single_host.sh start DIR   # configure in DIR, start the daemons, wait for the node
#   export SLURM_CONF=DIR/slurm.conf         # then: sbatch, srun, squeue, sinfo
#   scripts/slurm_single_host.sh stop DIR    # stop them
#
# The node offers this machine's CPUs, no GPUs; processes are tracked without cgroups
# (proctrack/linuxproc, task/none), so it also runs in containers. Exits non-zero, saying what
# failed and where the daemons' logs are, when a daemon does not start or the node does not
# come up within 30 s.
set -euo pipefail
cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR" >&2
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

stop() {
  for p in slurmd slurmctld; do
    [ -f "$dir/$p.pid" ] && kill "$(cat "$dir/$p.pid")" 2> /dev/null || true
  done
  return 0
}

if [ "$cmd" = stop ]; then
  stop
  exit 0
fi
[ "$cmd" = start ] || { echo "$0: unknown command '$cmd' (start or stop)" >&2; exit 2; }
for p in slurmctld slurmd munged sbatch; do
  command -v "$p" > /dev/null || [ -x "/usr/sbin/$p" ] ||
    { echo "$0: $p not found: install slurm-wlm and munge (scripts/setup.sh does)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "$0: needs root (the daemons run as root here)" >&2; exit 1; }

# munge: a key, and the daemon (one per host; an already running one is kept).
if ! munge -n > /dev/null 2>&1; then
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2> /dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge 2> /dev/null || true
  su -s /bin/sh munge -c /usr/sbin/munged 2> "$dir/munged.err" || /usr/sbin/munged --force \
    2>> "$dir/munged.err" || { echo "$0: munged did not start: $(cat "$dir/munged.err")" >&2; exit 1; }
fi

host=$(hostname -s)
mkdir -p "$dir/spool" "$dir/state"
cat > "$conf" << CONF
ClusterName=shardtrain
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SlurmdSpoolDir=$dir/spool
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ReturnToService=2
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
stop
slurmctld -f "$conf" || { echo "$0: slurmctld did not start (log: $dir/slurmctld.log)" >&2; exit 1; }
slurmd -f "$conf" || { echo "$0: slurmd did not start (log: $dir/slurmd.log)" >&2; exit 1; }
for _ in $(seq 60); do
  if sinfo -h -o %t 2> /dev/null | grep -qx idle; then
    echo "slurm: one-host cluster up ($host, $(nproc) CPUs); export SLURM_CONF=$conf"
    exit 0
  fi
  sleep 0.5
done
echo "$0: the node did not come up within 30 s: $(sinfo 2>&1 | tail -n 1); logs: $dir/slurmctld.log, $dir/slurmd.log" >&2
exit 1
