"""The door to MPI: the grid of ranks (topology), message tags and headers (protocol), timed
waits and collectives (comm), and the ranks that join a running job (joins). Layers above
speak through these modules.

One setting is made here, before any of them loads mpi4py: in a rank that an MPICH-style
launcher started (Hydra, or ``srun`` with PMI: ``PMI_RANK`` is set and Open MPI's variables
are not), UCX is kept off CMA (``UCX_TLS=^cma``) unless the user set ``UCX_TLS``. MPICH
sends between two launches (a job and the ranks that joined it) through UCX, and UCX reads a
large message on one node straight from the sender's memory (``process_vm_readv``): if the
sender dies during the read, UCX aborts the reader, and a joined replica's death becomes a
lost shard. Without CMA, UCX copies through shared memory and the dead sender is an error
hpcps handles. (A send *to* a dead peer of another launch is the other half, kept away in
:mod:`hpcps.mpi.joins`.) The job's own ranks on one node talk through MPICH's shared memory,
and ranks on different nodes never use CMA, so nothing else changes. Under Open MPI, ranks
cannot join a job and a job's own traffic may use UCX, so nothing is set; nor in a process
that only imports hpcps (a test runner), whose environment every launch it starts inherits.
"""
import os

if "PMI_RANK" in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ:
    os.environ.setdefault("UCX_TLS", "^cma")
