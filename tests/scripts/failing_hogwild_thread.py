"""Hogwild thread 1 of world rank 1 fails mid-training (--threads 2 --partitions 2): the rank
must fail, not wait for its other thread, and the job must end at once, not hang.

Usage: mpiexec -n 4 python failing_hogwild_thread.py <hpcps.train options>
"""
import sys
import threading

from hpcps.engine import partitioned_hogwild
from hpcps.mpi.topology import world_comm
from hpcps.train import main

rank = world_comm().Get_rank()
step = partitioned_hogwild.PartitionedHogwild._step
calls = [0]


def failing_step(self, t, *args):
    if rank == 1 and t == 1:
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError(f"injected failure on purpose in {threading.current_thread().name}")
    return step(self, t, *args)


partitioned_hogwild.PartitionedHogwild._step = failing_step

sys.exit(main(sys.argv[1:]))
