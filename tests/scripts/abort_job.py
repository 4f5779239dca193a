"""Rank 1 fails while the other ranks wait on it forever: the job must end at once, not hang."""
from hpcps.mpi.topology import world_comm
from hpcps.job import guarded

world = world_comm()


def work():
    if world.Get_rank() == 1:
        raise RuntimeError("injected failure on purpose")
    world.recv(source=1)  # never satisfied: only the abort can end this rank


guarded(world, "test", work)
