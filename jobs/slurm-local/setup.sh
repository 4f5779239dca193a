#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for trying the batch scripts in jobs/ and for the
# tests (tests/test_slurm.py) and CI (.ci/run). Debian/Ubuntu's slurm-wlm and munge; as root.
#
#   jobs/slurm-local/setup.sh start [--install]   # install (apt-get) if asked, start, wait idle
#   jobs/slurm-local/setup.sh status              # exit 0 when sbatch would work now
#   jobs/slurm-local/setup.sh stop                # stop the daemons this script started
#
# Idempotent: "start" leaves a working cluster alone, restarts daemons that died or run an
# older configuration, and resumes a node left down or drained. The node declares
# HPCPS_SLURM_CPUS CPUs (default 8) whatever the machine has (SlurmdParameters=config_overrides),
# so 4-8 tasks fit on a 2-core machine. MpiDefault=pmi2: srun starts mpi4py with the mpich
# wheel's library as one MPI job. ProctrackType=proctrack/linuxproc and TaskPlugin=task/none
# need no cgroups (containers often have none to give).
#
# Exit codes: 0 ready (or stopped), 2 Slurm or munge not installed, 3 not root, 4 another
# Slurm configuration is in /etc/slurm (a real cluster's: left alone), 5 failed to start
# (the daemons' logs are printed).
set -euo pipefail

STATE=${HPCPS_SLURM_STATE:-/var/lib/hpcps-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by hpcps jobs/slurm-local/setup.sh"
CPUS=${HPCPS_SLURM_CPUS:-8}
NODE=$(hostname -s)

say() { echo "slurm-local: $*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        say "needs root (slurmd and slurmctld run as root here); run it with sudo"
        exit 3
    fi
}

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null
}

install() {
    if installed; then return 0; fi
    if ! command -v apt-get >/dev/null; then
        say "slurm-wlm and munge are not installed and there is no apt-get to install them"
        exit 2
    fi
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q slurm-wlm munge >"$STATE/apt.log" 2>&1; then
        apt-get update -q >>"$STATE/apt.log" 2>&1 || true
        if ! apt-get install -y -q slurm-wlm munge >>"$STATE/apt.log" 2>&1; then
            tail -5 "$STATE/apt.log" >&2
            say "apt-get could not install slurm-wlm and munge (log: $STATE/apt.log)"
            exit 2
        fi
    fi
}

install_pmix() {
    # The PMIx library Slurm's mpi/pmix plugin loads (srun --mpi=pmix, which Open MPI 5 needs);
    # the plugin looks for the unversioned libpmix.so, which libpmix-dev provides. Optional:
    # without it srun --mpi=pmix fails ("Cannot create context for mpi/pmix") and the test
    # that uses it skips. Before the daemons start: slurmd loads the plugin once, at start.
    if ls /usr/lib/*/pmix2/lib/libpmix.so >/dev/null 2>&1; then return 0; fi
    command -v apt-get >/dev/null || return 0
    say "installing libpmix-dev (for srun --mpi=pmix) with apt-get"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libpmix-dev >>"$STATE/apt.log" 2>&1 \
        || say "libpmix-dev not installed: srun --mpi=pmix will not work (log: $STATE/apt.log)"
}

write_conf() {
    # The configuration this script wants; rewritten (and the daemons restarted) if it differs.
    local mem
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    cat <<EOF
$MARK
# A one-node cluster for trying hpcps's jobs; see jobs/slurm-local/setup.sh.
ClusterName=hpcps-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
# test all pending jobs every second (default 60 s): a requeued job starts as soon as it may
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() {  # alive PIDFILE: the process named in it runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then return 0; fi
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating a munge key"
        if command -v mungekey >/dev/null; then
            mungekey --create --force >/dev/null
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    # as the munge user when it exists (munged refuses root without --force)
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || true
    else
        /usr/sbin/munged --force || true
    fi
    for _ in $(seq 50); do munge_ok && return 0; sleep 0.1; done
    say "munged did not start (try: munged -F to see why)"
    exit 5
}

stop_daemon() {  # stop_daemon NAME PIDFILE: only the process this configuration started
    local pid
    if alive "$2"; then
        pid=$(cat "$2")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$1 (pid $pid) did not stop on SIGTERM: killing it"
            kill -9 "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$2"
}

ready() {  # the controller answers and the node takes jobs
    timeout 10 scontrol ping 2>/dev/null | grep -q "is UP" || return 1
    local state
    state=$(timeout 10 sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1)
    case "$state" in idle*|mixed*|allocated*|completing*) return 0 ;; esac
    return 1
}

fail_with_logs() {
    say "$1"
    for f in "$STATE/slurmctld.log" "$STATE/slurmd.log"; do
        [ -f "$f" ] && { echo "--- tail of $f" >&2; tail -15 "$f" >&2; }
    done
    exit 5
}

start() {
    need_root
    mkdir -p "$STATE/ctld" "$STATE/d"
    if [ "${1:-}" = "--install" ]; then install; install_pmix; fi
    if ! installed; then
        say "slurm-wlm and munge are not installed (start --install installs them with apt-get)"
        exit 2
    fi
    if [ -f "$CONF" ] && ! head -1 "$CONF" | grep -qF "$MARK"; then
        say "$CONF exists and was not written by this script: a real cluster's; left alone"
        exit 4
    fi
    local want
    want=$(write_conf)
    if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$want" ]; then
        printf '%s\n' "$want" >"$CONF"
        say "wrote $CONF"
        stop_daemon slurmd "$STATE/slurmd.pid"
        stop_daemon slurmctld "$STATE/slurmctld.pid"
    fi
    start_munge
    if ! alive "$STATE/slurmctld.pid"; then
        rm -f "$STATE/slurmctld.pid"
        slurmctld || fail_with_logs "slurmctld did not start"
    fi
    if ! alive "$STATE/slurmd.pid"; then
        rm -f "$STATE/slurmd.pid"
        slurmd || fail_with_logs "slurmd did not start"
    fi
    for i in $(seq 60); do
        if ready; then say "ready: node $NODE, $CPUS CPUs, partition local"; return 0; fi
        if [ "$i" = 10 ] || [ "$i" = 30 ]; then  # down or drained from an earlier life
            scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.5
    done
    fail_with_logs "the cluster did not become ready within 30 s"
}

case "${1:-}" in
    start) shift; start "$@" ;;
    status) installed && [ -f "$CONF" ] && ready ;;
    stop)
        need_root
        stop_daemon slurmd "$STATE/slurmd.pid"
        stop_daemon slurmctld "$STATE/slurmctld.pid"
        say "stopped slurmd and slurmctld (munged is left running)"
        ;;
    *) echo "usage: $0 start [--install] | status | stop" >&2; exit 64 ;;
esac
