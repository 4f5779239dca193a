#!/bin/bash
# Emulated hosts on this machine: K Linux network namespaces joined by veth links to one
# bridge, every link shaped to RATE with tc's token bucket (tbf). Needs root, ip and tc.
# Only the rate is shaped: this kernel has no netem (no added delay), so the latency is the
# veth's own (measured by bench/cluster/pingpong.py, tens of microseconds).
#
#   bench/cluster/netns.sh up K RATE         # e.g. up 4 1gbit
#   bench/cluster/netns.sh down              # removes every namespace and link it made
#   bench/cluster/netns.sh exec HOST CMD...  # run CMD inside host HOST (1..K, or its address)
#   bench/cluster/netns.sh status
#
# Host i is namespace hpcps-h<i> with address 10.77.0.<i>/24 on its eth0; the bridge
# hpcps-br holds 10.77.0.254 (where mpiexec listens for its proxies). A packet from host i
# to host j leaves through i's eth0 and enters j through the bridge port: both are shaped
# to RATE, so each host sends and receives at most RATE (a switched network's full duplex).
set -euo pipefail
NS=hpcps-h
BR=hpcps-br
NET=10.77.0

burst() {  # bytes the bucket holds: half a millisecond at RATE, at least 64 KiB (a GSO packet)
    local r=$1 num unit bps
    num=${r%%[a-z]*}; unit=${r#"$num"}
    case $unit in
        mbit) bps=$((num * 1000000)) ;;
        gbit) bps=$((num * 1000000000)) ;;
        *) echo "rate must end in mbit or gbit, got $r" >&2; exit 2 ;;
    esac
    local b=$((bps / 8 / 2000))
    [ "$b" -lt 65536 ] && b=65536
    echo "$b"
}

down() {
    local n
    for n in $(ip netns list | awk '{print $1}' | grep "^${NS}[0-9]*$" || true); do
        ip netns delete "$n"
    done
    for n in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep '^hpcps-v' || true); do
        ip link delete "$n" 2>/dev/null || true
    done
    if ip link show "$BR" >/dev/null 2>&1; then ip link delete "$BR"; fi
}

up() {
    local K=$1 rate=$2 b i
    b=$(burst "$rate")
    down
    ip link add "$BR" type bridge
    ip addr add "$NET.254/24" dev "$BR"
    ip link set "$BR" up
    for i in $(seq 1 "$K"); do
        ip netns add "$NS$i"
        ip link add "hpcps-v$i" type veth peer name eth0 netns "$NS$i"
        ip link set "hpcps-v$i" master "$BR"
        ip link set "hpcps-v$i" up
        ip netns exec "$NS$i" ip link set lo up
        ip netns exec "$NS$i" ip addr add "$NET.$i/24" dev eth0
        ip netns exec "$NS$i" ip link set eth0 up
        # one bucket per direction; 20 ms of queue before it drops (TCP then backs off)
        tc qdisc add dev "hpcps-v$i" root tbf rate "$rate" burst "$b" latency 20ms
        ip netns exec "$NS$i" tc qdisc add dev eth0 root tbf rate "$rate" burst "$b" latency 20ms
    done
}

host_ns() {  # 3 or 10.77.0.3 -> hpcps-h3
    local h=$1
    h=${h#"$NET."}
    case $h in ''|*[!0-9]*) echo "unknown emulated host $1" >&2; exit 2 ;; esac
    echo "$NS$h"
}

case "${1:-}" in
    up) [ $# -eq 3 ] || { echo "usage: $0 up K RATE" >&2; exit 2; }; up "$2" "$3" ;;
    down) down ;;
    exec) shift; ns=$(host_ns "$1"); shift; exec ip netns exec "$ns" "$@" ;;
    status) ip netns list | grep "^$NS" || echo "no emulated hosts"; tc qdisc show | grep hpcps-v || true ;;
    *) echo "usage: $0 up K RATE | down | exec HOST CMD... | status" >&2; exit 2 ;;
esac
