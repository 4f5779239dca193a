"""MPI ping-pong between world ranks 0 and 1: the network's latency and bandwidth as MPI sees
them (alpha: half the round trip of an 8-byte message; beta: seconds per byte from the
round trip of large messages). Prints one JSON object.

    mpiexec -n 2 python bench/cluster/pingpong.py [--repeats N]

Run inside the emulated cluster by ``bench/cluster/run.py`` to measure the network the
scaling model (:mod:`hpcps.scaling`) is checked against.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI


def round_trip(comm, buf: np.ndarray, repeats: int) -> float:
    """Median seconds of one round trip of ``buf`` between ranks 0 and 1."""
    rank = comm.Get_rank()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--mib", type=float, default=8.0, help="large message size, MiB")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    small = np.zeros(8, np.uint8)
    big = np.zeros(int(args.mib * 2**20), np.uint8)
    round_trip(comm, big, 2)  # connect and warm up
    rt_small = round_trip(comm, small, args.repeats * 10)
    rt_big = round_trip(comm, big, args.repeats)
    if comm.Get_rank() == 0:
        alpha = rt_small / 2
        beta = max(rt_big / 2 - alpha, 1e-12) / big.nbytes
        print(json.dumps({"alpha_s": alpha, "beta_s_per_byte": beta,
                          "bandwidth_gbit_s": 8 / beta / 1e9, "message_bytes": big.nbytes,
                          "hosts": [MPI.Get_processor_name()]}), flush=True)


if __name__ == "__main__":
    main()
