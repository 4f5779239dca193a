#!/bin/bash
# hydra's launcher for the emulated hosts: mpiexec -launcher ssh -launcher-exec <this> calls
# it as ssh would be called, "[-x] HOST COMMAND...", and it runs COMMAND (hydra's proxy)
# inside HOST's network namespace instead of logging in.
[ "${1:-}" = "-x" ] && shift
host=$1; shift
here=$(dirname "$(readlink -f "$0")")
exec "$here/netns.sh" exec "$host" sh -c "$*"
