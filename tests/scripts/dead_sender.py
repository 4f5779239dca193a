"""Rank 1 starts sending rank 0 a large message and exits before rank 0 receives it; rank 0
then receives it, with ``Transport.take`` (argument ``take``) or a receive waited on by
``wait_all`` (``wait``), and prints one JSON line saying what was raised.

MPICH copies a large message on one node straight from the sender's memory
(``process_vm_readv``), which fails once the sender is gone: ``take`` must report that as
:class:`hpcps.mpi.comm.PeerDied` naming rank 1, and ``wait_all`` as
:class:`hpcps.mpi.comm.PeerFailed`, not as MPI's error stack. Run with 2 ranks under
``mpiexec -disable-auto-cleanup`` (Hydra then lets rank 0 run on after rank 1 ends).
"""
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcps.mpi.comm import PeerFailed, Transport, wait_all
from hpcps.mpi.protocol import Tag

signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Hydra's notice that a rank has ended
world = MPI.COMM_WORLD
WORDS = 1 << 22  # 16 MiB of float32: far past the eager limit, read from the sender's memory

if world.Get_rank() == 1:
    world.send(os.getpid(), dest=0, tag=5)
    req = world.Isend(np.ones(WORDS, np.float32), dest=0, tag=Tag.PUSH)
    world.recv(source=0, tag=6)  # rank 0 has probed the message: it is announced
    os._exit(0)  # gone before rank 0 takes it


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


pid = world.recv(source=1, tag=5)
status = MPI.Status()
deadline = time.monotonic() + 60
while not world.Iprobe(1, Tag.PUSH, status):
    assert time.monotonic() < deadline, "rank 1's message never came"
    time.sleep(0.01)
world.send(None, dest=1, tag=6)
while not gone(pid):
    assert time.monotonic() < deadline, "rank 1 did not end"
    time.sleep(0.01)
buf = np.empty(WORDS, np.float32)
try:
    if sys.argv[1] == "take":
        Transport(world).take(buf, 1, Tag.PUSH)
    else:
        wait_all([world.Irecv(buf, source=1, tag=Tag.PUSH)], 30, "rank 1's push")
    out = {"raised": None}
except PeerFailed as exc:
    out = {"raised": type(exc).__name__, "message": str(exc), "lost": list(exc.lost),
           "exit_code": exc.exit_code}
print(json.dumps(out), flush=True)
sys.stderr.flush()
os._exit(0)  # no MPI_Finalize: it would wait for the dead rank
