#!/bin/bash
# hydra's launcher for the emulated hosts: mpiexec -launcher ssh -launcher-exec <this> calls
# it as ssh would be called, "[-x] HOST COMMAND...", and it runs COMMAND (hydra's proxy)
# inside HOST's network namespace instead of logging in, pinned to one core of this machine:
# host k (10.77.0.k) to core (k - 1) mod nproc, so the hosts spread evenly over the cores
# and stay where they start (HPCPS_CLUSTER_PIN=0: no pinning, the scheduler places them).
[ "${1:-}" = "-x" ] && shift
host=$1; shift
here=$(dirname "$(readlink -f "$0")")
if [ "${HPCPS_CLUSTER_PIN:-1}" != 0 ] && command -v taskset >/dev/null; then
    k=${host##*.}
    # the cores this process may use (nproc would take OMP_NUM_THREADS for the count)
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    exec "$here/netns.sh" exec "$host" taskset -c $(( (k - 1) % cores )) sh -c "$*"
fi
exec "$here/netns.sh" exec "$host" sh -c "$*"
