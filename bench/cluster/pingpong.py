"""MPI ping-pong between world ranks 0 and 1: the network's latency and bandwidth as MPI sees
them (alpha: half the round trip of an 8-byte message; beta: seconds per byte from the
round trip of large messages). Prints one JSON object.

    mpiexec -n 2 python bench/cluster/pingpong.py [--repeats N]
    mpiexec -n 8 python bench/cluster/pingpong.py     # 0 and 1 ping-pong, 2-7 compute

With more than two ranks, ranks 2 and up compute while 0 and 1 measure, as the ranks of a
training job do between their messages (sgemm of a mini-batch's size, until rank 0 tells them
to stop). On hosts that share cores (the emulated cluster) this measures the latency and
bandwidth two ranks see while N training ranks share the cores: a message waits for its
receiver to be scheduled, and TCP's copies compete for the cores with the computing ranks.

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


STOP = 7  # tag of rank 0's message that ends a bystander's work


def bystander(comm) -> None:
    """Compute, as a training rank does, until rank 0 says stop."""
    a = np.random.default_rng(comm.Get_rank()).standard_normal((32, 512), dtype=np.float32)
    w = np.zeros((512, 512), np.float32)
    while not comm.Iprobe(source=0, tag=STOP):
        a @ w
    comm.recv(source=0, tag=STOP)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--mib", type=float, default=8.0, help="large message size, MiB")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED)
    if pair == MPI.COMM_NULL:
        bystander(world)
        return
    comm = pair
    small = np.zeros(8, np.uint8)
    big = np.zeros(int(args.mib * 2**20), np.uint8)
    round_trip(comm, big, 2)  # connect and warm up
    rt_small = round_trip(comm, small, args.repeats * 10)
    rt_big = round_trip(comm, big, args.repeats)
    if comm.Get_rank() == 0:
        for r in range(2, world.Get_size()):
            world.send(None, dest=r, tag=STOP)
        alpha = rt_small / 2
        beta = max(rt_big / 2 - alpha, 1e-12) / big.nbytes
        print(json.dumps({"alpha_s": alpha, "beta_s_per_byte": beta,
                          "bandwidth_gbit_s": 8 / beta / 1e9, "message_bytes": big.nbytes,
                          "ranks": world.Get_size(),
                          "hosts": [MPI.Get_processor_name()]}), flush=True)


if __name__ == "__main__":
    main()
