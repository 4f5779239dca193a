#!/bin/bash
# mpiexec for the emulated hosts (bench/cluster/netns.sh up K RATE first): one rank per host,
# rank i on 10.77.0.<i+1>, hydra's proxies started inside the namespaces by launch.sh, and MPI
# over TCP between them, shared memory off. Takes mpiexec's usual "-n N CMD..." and nothing
# else; N must not exceed the number of hosts that are up.
#
#   bench/cluster/mpiexec.sh -n 4 python -m hpcps.train --strategy sync
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
[ "${1:-}" = "-n" ] && [ $# -ge 3 ] || { echo "usage: $0 -n N COMMAND..." >&2; exit 2; }
n=$2; shift 2
up=$(ip netns list | grep -c '^hpcps-h[0-9]' || true)
if [ "$n" -gt "$up" ]; then
    echo "$0: $n ranks but $up emulated hosts are up (bench/cluster/netns.sh up K RATE)" >&2
    exit 2
fi
hosts=$(seq -s, -f '10.77.0.%g' 1 "$n")
# ch4:ofi over its tcp provider on each namespace's eth0; MPIR_CVAR_NOLOCAL makes every rank
# treat the others as remote (no shared memory although /dev/shm is one for all namespaces)
export FI_PROVIDER=tcp FI_TCP_IFACE=eth0 MPIR_CVAR_CH4_NETMOD=ofi MPIR_CVAR_NOLOCAL=1
mpiexec=${HPCPS_MPIEXEC:-$(dirname "$(command -v python)")/mpiexec}
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec)
exec "$mpiexec" -iface hpcps-br -hosts "$hosts" -launcher ssh -launcher-exec "$here/launch.sh" \
    -n "$n" "$@"
