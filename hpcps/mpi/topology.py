"""The grid of ranks: who is a server shard, who is which partition of which replica.

::

    N = S servers + C coordinator (0 or 1) + R replicas x P partitions + K spares

    world rank  0 .. R*P-1          replica r = rank // P, partition p = rank % P
    world rank  R*P .. R*P+S-1      server shard s = rank - R*P
    world rank  R*P+S               the coordinator, when there is one
    world rank  R*P+S+C ..          spare k (``--spares``), idle until it replaces a replica;
                                    it then trains as replica R + k
    N .. N+J-1                      rank j of those that join the running job (``--joins``),
                                    reached through an intercommunicator: spare K + j

Replicas come first so that world rank 0 is always replica 0, partition 0: the rank that logs,
evaluates and, for strategies without servers, writes checkpoints.

Everything here but :func:`build_grid` is pure and tested without MPI. This is the only module
that touches ``MPI.COMM_WORLD``; it hands everyone else a duplicate of it, so hpcps traffic never
mixes with a user's own.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from hpcps.blocks import block_range
from hpcps.errors import ConfigError

ABORT_GRACE_S = 0.5  # seconds a failing rank's last output gets before the job is killed


@dataclass(frozen=True)
class Layout:
    """How N ranks split into servers, replicas and partitions."""

    n_world: int
    servers: int
    replicas: int
    partitions: int = 1
    coordinator: int = 0
    spares: int = 0
    joins: int = 0  # ranks that may join the running job (--joins), past the world's

    @classmethod
    def plan(cls, n_world: int, servers: int, partitions: int = 1, coordinator: int = 0,
             min_replicas: int = 1, spares: int = 0, joins: int = 0) -> "Layout":
        """Fit S servers, C coordinators, K spares and replicas of P partitions into N ranks.

        Replicas fill what is left. Raises ConfigError naming N, S and P and what would fit.
        """
        if n_world < 1:
            raise ConfigError(f"need at least one rank, got N={n_world}")
        if servers < 0 or partitions < 1 or coordinator not in (0, 1) or spares < 0:
            raise ConfigError(f"impossible layout: servers S={servers}, partitions P={partitions}")
        rest = n_world - servers - coordinator - spares
        replicas = rest // partitions if rest > 0 else 0
        if replicas < min_replicas or rest != replicas * partitions:
            fits = [servers + coordinator + spares + r * partitions
                    for r in range(min_replicas, n_world + 2)]
            below = [n for n in fits if n < n_world][-1:]
            above = [n for n in fits if n > n_world][:1]
            extra = f" + {coordinator} coordinator" if coordinator else ""
            extra += f" + {spares} spare(s)" if spares else ""
            hint = (f"S{extra} + R*P ranks with R >= {min_replicas} replicas fit "
                    f"N = {' or '.join(str(n) for n in below + above)}")
            raise ConfigError(f"cannot lay out N={n_world} ranks as S={servers} server shards"
                              f"{extra} and replicas of P={partitions} partitions: {hint}")
        return cls(n_world, servers, replicas, partitions, coordinator, spares, joins)

    # -- pure role arithmetic -------------------------------------------------------------
    def replica_rank(self, replica: int, partition: int = 0) -> int:
        return replica * self.partitions + partition

    def server_rank(self, shard: int) -> int:
        return self.replicas * self.partitions + shard

    @property
    def server_ranks(self) -> list[int]:
        return [self.server_rank(s) for s in range(self.servers)]

    def spare_rank(self, k: int) -> int:
        """Rank of spare k: one of the job's K, or past them rank ``N + k - K`` of a joined one."""
        if k >= self.spares:
            return self.n_world + k - self.spares
        return self.replicas * self.partitions + self.servers + self.coordinator + k

    def may_die(self, rank: int) -> bool:
        """Whether the run survives the loss of ``rank`` when replicas may die (a joined rank
        is a spare)."""
        return rank >= self.n_world or self.role(rank).may_die

    @property
    def trainers(self) -> int:
        """Replica indices a server may hear from: the R replicas, then the K spares and the J
        ranks that may join, spare k training as replica R + k once it is handed a data shard
        (P = 1)."""
        return self.replicas + self.spares + self.joins

    @property
    def shard_table(self) -> list[int]:
        """World rank of each shard index a server may hear from: the S shards, then the K
        spares, spare k serving as shard S + k once it restores a dead shard's copies."""
        return self.server_ranks + [self.spare_rank(k) for k in range(self.spares)]

    def trainer_rank(self, r: int) -> int:
        """World rank of replica index ``r``: a replica's (partition 0), or past R a spare's."""
        return self.replica_rank(r) if r < self.replicas else self.spare_rank(r - self.replicas)

    def role(self, rank: int) -> "Role":
        if not 0 <= rank < self.n_world:
            raise ValueError(f"rank {rank} outside 0..{self.n_world - 1}")
        n_rep = self.replicas * self.partitions
        if rank < n_rep:
            return Role("replica", replica=rank // self.partitions,
                        partition=rank % self.partitions)
        if rank < n_rep + self.servers:
            return Role("server", shard=rank - n_rep)
        if rank < n_rep + self.servers + self.coordinator:
            return Role("coordinator")
        return Role("spare", spare=rank - n_rep - self.servers - self.coordinator)


@dataclass(frozen=True)
class Role:
    kind: str
    replica: int = -1
    partition: int = -1
    shard: int = -1
    spare: int = -1

    @property
    def is_replica(self) -> bool:
        return self.kind == "replica"

    @property
    def is_server(self) -> bool:
        return self.kind == "server"

    @property
    def may_die(self) -> bool:
        """A rank whose death the run survives when replicas may die: a replica or a spare."""
        return self.kind in ("replica", "spare")


def shard_range(n_params: int, n_shards: int, shard: int) -> tuple[int, int]:
    """The contiguous chunk [lo, hi) of the flat parameter vector held by ``shard``.

    Balanced: chunk sizes differ by at most one element, earlier shards hold the larger ones.
    """
    if n_shards < 1:
        raise ValueError(f"need at least one shard, got {n_shards}")
    if n_params < n_shards:
        raise ConfigError(f"{n_shards} server shards for a model of only {n_params} parameters: "
                          "use fewer --servers")
    return block_range(n_params, n_shards, shard)


@dataclass
class Grid:
    """A rank's communicators, built once at start by :func:`build_grid`.

    Attributes
    ----------
    world : the duplicate of COMM_WORLD all hpcps traffic uses (client <-> server messages).
    layout, role : as above.
    server_comm : the S shard ranks (None on other ranks).
    replica_comm : the P ranks of this rank's replica (None on servers).
    partition_comm : the R ranks holding this rank's partition in every replica (None on servers).
    """

    world: object
    layout: Layout
    role: Role
    server_comm: object | None
    replica_comm: object | None
    partition_comm: object | None

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def is_chief(self) -> bool:
        """World rank 0 (replica 0, partition 0): logs, evaluates, reports."""
        return self.rank == 0


def world_comm():
    """A duplicate of COMM_WORLD, for the checks that run before the layout is known."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.Dup()


def check_thread_support(threads: int, partitions: int, provided: int | None = None) -> None:
    """Refuse ``--threads T --partitions P`` (T, P > 1) unless MPI gives MPI_THREAD_MULTIPLE:
    then T threads of one rank each run collectives with the other partitions at once.
    ``provided`` is the thread level to judge (default: what this process got)."""
    if threads <= 1 or partitions <= 1:
        return
    from mpi4py import MPI
    if provided is None:
        provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                 "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise ConfigError(
            f"--threads {threads} with --partitions {partitions} needs an MPI library with "
            f"MPI_THREAD_MULTIPLE (each of the {threads} threads exchanges activations with "
            f"the other partitions at the same time), but this one provides only "
            f"{names.get(provided, provided)}: use an MPI built with thread support (MPICH "
            "--enable-threads=multiple, Open MPI --enable-mpi-thread-multiple), or "
            "--threads 1, or --partitions 1")


def abort(code: int) -> None:
    """End every rank of the job now (one failing rank must never leave the others hanging).

    Output is flushed and given a moment to travel first: mpiexec forwards each rank's
    stdout/stderr through its process manager, and an abort that kills the job at once
    lost the failing rank's last message in about one run in five (measured with a test
    whose Hogwild thread fails)."""
    import time

    from mpi4py import MPI
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)


def build_grid(world, layout: Layout) -> Grid:
    """Split ``world`` into the communicators of the grid. Collective over ``world``."""
    from mpi4py import MPI
    rank = world.Get_rank()
    if world.Get_size() != layout.n_world:
        raise ConfigError(f"layout planned for N={layout.n_world} but the job has "
                          f"{world.Get_size()} ranks")
    role = layout.role(rank)
    undefined = MPI.UNDEFINED
    server_comm = world.Split(0 if role.is_server else undefined, rank)
    replica_comm = world.Split(role.replica if role.is_replica else undefined, rank)
    partition_comm = world.Split(role.partition if role.is_replica else undefined, rank)
    null = MPI.COMM_NULL
    return Grid(world, layout, role,
                None if server_comm == null else server_comm,
                None if replica_comm == null else replica_comm,
                None if partition_comm == null else partition_comm)
