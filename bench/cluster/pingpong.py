"""MPI's latency and bandwidth as a job sees them, in two patterns; prints one JSON object.

    mpiexec -n 2 python bench/cluster/pingpong.py [--repeats N]
    mpiexec -n 8 python bench/cluster/pingpong.py

The ring (``ring`` in the JSON): every rank sends to the next rank and receives from the
previous one at once, as each step of a ring allreduce does (and, in small messages,
deadreckon's step to every peer): alpha is one step of an 8-byte message, beta seconds per
byte from steps of ``--ring-mib``; the slowest rank's figure.

The ping-pong (the top-level figures): ranks 0 and 1 (alpha: half the round trip of an 8-byte
message; beta: seconds per byte from the round trip of ``--mib``), while ranks 2 and up
compute, as the ranks of a training job do between their messages (sgemm of a mini-batch's
size, until rank 0 tells them to stop): one pair's link, as a replica talking to a
parameter-server shard uses it.

The allreduce (``allreduce`` in the JSON): MPI's own Iallreduce (a sum of float32, as sync
and averaging call it), every rank at once, at ``--allreduce-mib`` sizes: seconds per call
at each size, the slowest rank's median. The collective's algorithm, its sum and its
pipelining make it slower than the ring's steps alone (17-60% on the emulated 10 Gb/s
network at 2.7-5.4 MB), and not linear in the size: the scaling model's cluster check
interpolates these times for sync's and averaging's vectors.

Each figure is the median over runs of the mean of steps or round trips taken back to back.
On hosts that share cores (the emulated cluster) a message waits for its receiver to be
scheduled, and TCP's copies compete for the cores with the computing ranks; a run of
dependent messages pays those waits, as a ring allreduce does.

Run inside the emulated cluster by ``bench/cluster/bench_cluster.py`` to measure the network
the scaling model (:mod:`hpcps.tools.scaling`) is checked against.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI


def _chained(comm, chain: int, chains: int, one) -> float:
    """The median over ``chains`` of the mean seconds of ``chain`` calls of ``one()`` taken
    back to back, a barrier only before each chain. On cores shared with other ranks some
    messages wait for a rank to be scheduled: the mean counts those waits as a run of
    dependent messages pays them; a barrier before every call would hide them (both ranks
    running when the clock starts)."""
    means = []
    for _ in range(chains):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(chain):
            one()
        means.append((time.perf_counter() - t) / chain)
    return statistics.median(means)


def round_trip(comm, buf: np.ndarray, chain: int, chains: int) -> float:
    """Seconds of one round trip of ``buf`` between ranks 0 and 1 (:func:`_chained`)."""
    rank = comm.Get_rank()

    def one():
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    return _chained(comm, chain, chains, one)


def ring_step(comm, buf: np.ndarray, chain: int, chains: int) -> float:
    """Seconds of one step of a ring, every rank sending ``buf`` to the next rank and
    receiving as much from the previous one at once (a ring allreduce's step;
    :func:`_chained`), the slowest rank's. On hosts of their own this is a ping-pong's one
    way (full-duplex links); on shared cores all ranks' TCP work and waits compete for the
    cores."""
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size
    incoming = np.empty_like(buf)

    def one():
        comm.Sendrecv(buf, dest=right, recvbuf=incoming, source=left)
    return max(comm.allgather(_chained(comm, chain, chains, one)))


def allreduce_times(comm, sizes_mib: list[float], repeats: int) -> dict:
    """Seconds of one Iallreduce (MPI.SUM of float32, waited on to completion) of each size,
    every rank at once: the slowest rank's median over ``repeats`` calls after one untimed."""
    nbytes, seconds = [], []
    for mib in sizes_mib:
        buf = np.ones(max(1, int(mib * 2**20) // 4), np.float32)
        times = []
        for i in range(repeats + 1):
            comm.Barrier()
            t = time.perf_counter()
            comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait()
            if i:
                times.append(time.perf_counter() - t)
        nbytes.append(buf.nbytes)
        seconds.append(max(comm.allgather(statistics.median(times))))
    return {"bytes": nbytes, "seconds": seconds}


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
    p.add_argument("--repeats", type=int, default=20, help="runs of round trips (of 50 small "
                   "messages; of 4 large ones, half as many runs)")
    p.add_argument("--mib", type=float, default=8.0, help="large message size, MiB")
    p.add_argument("--ring-mib", type=float, default=1.0,
                   help="a ring step's large message, MiB (a ring allreduce's step moves "
                        "1/N of the vector)")
    p.add_argument("--allreduce-mib", default="0.000008,1,2,4,8",
                   help="Iallreduce sizes, MiB, comma-separated (the first: its latency)")
    p.add_argument("--allreduce-repeats", type=int, default=5)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    small = np.zeros(8, np.uint8)
    ring_big = np.zeros(int(args.ring_mib * 2**20), np.uint8)
    ring_step(world, ring_big, 1, 1)  # connect
    ring_small_s = ring_step(world, small, 50, args.repeats)
    ring_big_s = ring_step(world, ring_big, 4, args.repeats // 2 or 1)
    allreduce = allreduce_times(world, [float(v) for v in args.allreduce_mib.split(",")],
                                args.allreduce_repeats)
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED)
    if pair == MPI.COMM_NULL:
        bystander(world)
        return
    comm = pair
    big = np.zeros(int(args.mib * 2**20), np.uint8)
    round_trip(comm, big, 2, 1)  # connect and warm up
    rt_small = round_trip(comm, small, 50, args.repeats)
    rt_big = round_trip(comm, big, 4, args.repeats // 2 or 1)
    if comm.Get_rank() == 0:
        for r in range(2, world.Get_size()):
            world.send(None, dest=r, tag=STOP)
        alpha = rt_small / 2
        beta = max(rt_big / 2 - alpha, 1e-12) / big.nbytes
        ring_beta = max(ring_big_s - ring_small_s, 1e-12) / ring_big.nbytes
        print(json.dumps({"alpha_s": alpha, "beta_s_per_byte": beta,
                          "bandwidth_gbit_s": 8 / beta / 1e9, "message_bytes": big.nbytes,
                          "ring": {"alpha_s": ring_small_s, "beta_s_per_byte": ring_beta,
                                   "bandwidth_gbit_s": 8 / ring_beta / 1e9,
                                   "message_bytes": ring_big.nbytes},
                          "allreduce": allreduce,
                          "ranks": world.Get_size(),
                          "hosts": [MPI.Get_processor_name()]}), flush=True)


if __name__ == "__main__":
    main()
