"""The door to MPI: the grid of ranks (topology), message tags and headers (protocol), timed
waits and collectives (comm). Layers above speak through these modules.

Before MPI starts (every module here that loads mpi4py is imported after this file runs),
UCX is kept off CMA unless the user chose UCX's transports (``UCX_TLS``). Between two launches
(ranks that joined a job) MPICH sends through UCX, and UCX reads a large message on one node
straight from the sender's memory (``process_vm_readv``); if the sender dies during the read,
UCX aborts the reading process, which is then a shard lost to a replica's death. Without CMA
UCX copies through shared memory, and the dead sender is an error hpcps handles (a send *to*
a dead peer of another launch is the other half, kept away in :mod:`hpcps.mpi.joins`).
The job's own ranks on one node talk through MPICH's shared memory, not UCX, and
ranks on different nodes never use CMA, so nothing else changes. Only in a rank that an MPICH-style
launcher started (Hydra, or ``srun`` with PMI, which set ``PMI_RANK``): not under Open MPI,
where ranks cannot join a job and its own traffic may go through UCX, and not in a process
that only imports hpcps (a test runner), whose environment every launch it makes would
inherit.
"""
import os

if "PMI_RANK" in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ:
    os.environ.setdefault("UCX_TLS", "^cma")
