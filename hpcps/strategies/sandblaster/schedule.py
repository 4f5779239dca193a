"""Which replica computes which portion of a batch: the Sandblaster coordinator's work scheduler.

Sandblaster L-BFGS (Dean et al. 2012, "Large Scale Distributed Deep Networks", the DistBelief
paper, section 4.2) computes the gradient of one large batch with many model replicas. The
coordinator cuts the batch into *portions*, each much smaller than 1/R of the batch for R
replicas, and hands a replica a new portion whenever it is free, so fast replicas do more of
the work than slow ones and nobody waits for the slowest machine. This module is that hand-out
logic and nothing else: no MPI, no threads, no clock. The caller passes the current time
(``now``, seconds) and tells the scheduler what happened; it answers what to do next. That
makes every decision reproducible and testable without a cluster.

Portions
    The integers ``0 .. n_portions-1``. What a portion stands for (which rows of the batch) is
    the caller's business; portions are numbered in data order, so consecutive portions are
    consecutive rows.

Data affinity
    The portions are pre-split into contiguous regions, one per replica, in the order the
    replicas are given (balanced, the first regions one portion larger, as
    :func:`hpcps.blocks.block_range` splits everything else). A replica is always given the lowest
    unassigned portion of its own region, so it reads its rows sequentially and its prefetching
    pays off. Once its region is exhausted it helps the region with the most unassigned portions
    left, taking from that region's *end*: the owner keeps its consecutive run and the helper
    builds a consecutive run of its own from the other side.

Backup tasks
    Near the end of a batch a few slow replicas would hold everyone up. When no unassigned
    portion is left, an idle replica instead gets a copy of an outstanding portion (handed out
    but not yet computed) that fewer than ``max_copies`` replicas are computing, the one handed
    out longest ago first. The first result to arrive is used; later ones are discarded. This
    is the paper's use of MapReduce's backup tasks. ``max_copies=1`` turns backups off.

Why a result counts only once it is flushed
    A replica does not send one gradient per portion: it adds each portion's gradient to a
    local accumulator and pushes the sum to the parameter server every few portions
    (``flushed``), which keeps traffic low. A replica that dies before pushing takes the
    gradients of the portions it completed since its last push with it, so those portions are
    not done, whatever it reported: :meth:`PortionScheduler.lost` puts them back in the pool.
    A portion is *final* only once the replica whose result was accepted has flushed; the batch
    is finished when every portion is final.

Protocol, per replica::

    p = sched.next_for(r, now)            # None: nothing to do now; push, then ask again later
    ... compute the gradient of portion p ...
    if sched.completed(r, p, now):        # False: someone else was first; discard the gradient
        accumulate the gradient
    every few portions, and before waiting:  push the accumulator; sched.flushed(r)
    replica stopped answering:            sched.lost(r)
"""
from __future__ import annotations

import bisect
from typing import Sequence

from hpcps.blocks import block_range


class PortionScheduler:
    """Hands the portions 0..n_portions-1 of one batch to replicas; see the module docstring.

    Parameters
    ----------
    n_portions : int
        Number of portions in the batch, >= 1.
    replicas : sequence of int
        Ids of the replicas taking part, distinct; at least one. Their order fixes which
        region of portions each one owns.
    max_copies : int, default 2
        Most replicas computing the same portion at once, counting the first one; >= 1.
        1 disables backup tasks.

    Attributes
    ----------
    stats : dict
        Counters, for logging and tests:

        ``assigned``
            portions handed out by :meth:`next_for`, backup copies included;
        ``reissued``
            of those, backup copies of an outstanding portion;
        ``duplicates``
            results discarded because the portion had already been completed;
        ``requeued``
            portions returned to the pool by :meth:`lost`;
        ``completed``
            dict replica -> number of its results that were accepted.

    Raises
    ------
    ValueError
        On ``n_portions < 1``, no replicas, a duplicate replica id or ``max_copies < 1``.
    """

    def __init__(self, n_portions: int, replicas: Sequence[int], max_copies: int = 2):
        for name, value in (("n_portions", n_portions), ("max_copies", max_copies)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"PortionScheduler: {name} must be an int, got {value!r}")
        if n_portions < 1:
            raise ValueError(f"PortionScheduler: n_portions must be >= 1, got {n_portions}")
        if max_copies < 1:
            raise ValueError(f"PortionScheduler: max_copies must be >= 1, got {max_copies}")
        replicas = tuple(replicas)
        if not replicas:
            raise ValueError("PortionScheduler: needs at least one replica")
        if len(set(replicas)) != len(replicas):
            dup = sorted({r for r in replicas if replicas.count(r) > 1})
            raise ValueError(f"PortionScheduler: duplicate replica ids {dup}")

        self.n_portions = n_portions
        self.max_copies = max_copies
        self.replicas = replicas
        n_regions = len(replicas)
        self._region_of = {r: i for i, r in enumerate(replicas)}
        # Unassigned portions of each region, kept sorted: the owner pops from the front,
        # helpers from the back.
        self._pool: list[list[int]] = []
        self._home: list[int] = [0] * n_portions  # portion -> region it goes back to
        for i in range(n_regions):
            lo, hi = block_range(n_portions, n_regions, i)
            self._pool.append(list(range(lo, hi)))
            self._home[lo:hi] = [i] * (hi - lo)
        self._live: set[int] = set(replicas)
        self._current: dict[int, int] = {}  # replica -> portion it is computing
        # Portion -> {replica: time its copy was handed out}, for every copy in flight. A
        # portion stays here after a first result is accepted while other copies still run,
        # so that their late results are recognised as duplicates.
        self._copies: dict[int, dict[int, float]] = {}
        self._accepted_by: dict[int, int] = {}  # portion -> replica, result accepted, unflushed
        self._unflushed: dict[int, list[int]] = {r: [] for r in replicas}
        self._final: set[int] = set()
        self.stats: dict = {"assigned": 0, "reissued": 0, "duplicates": 0, "requeued": 0,
                            "completed": {r: 0 for r in replicas}}

    # -- queries ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """True when every portion is final: its accepted result has been flushed."""
        return len(self._final) == self.n_portions

    def pending_flush(self, replica: int) -> list[int]:
        """Portions whose result from ``replica`` was accepted but not yet flushed, ascending.

        These are the portions that :meth:`lost` would put back if the replica died now.
        """
        self._check_live(replica, "pending_flush")
        return sorted(self._unflushed[replica])

    # -- events ----------------------------------------------------------------------------

    def next_for(self, replica: int, now: float) -> int | None:
        """The portion an idle ``replica`` computes next, or None when there is none right now.

        In order of preference: the lowest unassigned portion of its own region; the last
        unassigned portion of the region with the most left (ties: the earlier region); a
        backup copy of the outstanding portion handed out longest ago that fewer than
        ``max_copies`` replicas compute and ``replica`` does not (ties: the lower portion).
        None means every portion is completed or at ``max_copies``: the caller should push
        its gradients and ask again after the next event.

        Parameters
        ----------
        replica : int
            A replica that is neither lost nor computing a portion.
        now : float
            Current time in seconds; it orders backup candidates by age.

        Raises
        ------
        ValueError
            If ``replica`` is unknown or lost, or its previous portion is still outstanding.
        """
        self._check_live(replica, "next_for")
        if replica in self._current:
            raise ValueError(f"next_for: replica {replica} is still computing portion "
                             f"{self._current[replica]}; report it with completed() first")
        own = self._pool[self._region_of[replica]]
        if own:
            return self._hand_out(replica, own.pop(0), now, backup=False)
        # max() keeps the first of equals, so ties go to the earlier region.
        richest = max(self._pool, key=len)
        if richest:
            return self._hand_out(replica, richest.pop(), now, backup=False)
        best = None
        for portion, copies in self._copies.items():
            if (portion in self._accepted_by or portion in self._final
                    or replica in copies or len(copies) >= self.max_copies):
                continue
            key = (min(copies.values()), portion)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        return self._hand_out(replica, best[1], now, backup=True)

    def completed(self, replica: int, portion: int, now: float) -> bool:
        """Record that ``replica`` finished computing ``portion``; it is idle again.

        Parameters
        ----------
        replica : int
            The replica reporting.
        portion : int
            The portion it was handed by its last :meth:`next_for`.
        now : float
            Current time in seconds. The decision does not depend on it; it is taken so that
            every event carries its time.

        Returns
        -------
        bool
            True if this is the first result for ``portion``: the replica must add the
            gradient to its accumulator, and the portion becomes final when it flushes.
            False if another copy finished first: the replica must discard the gradient.

        Raises
        ------
        ValueError
            If ``replica`` is unknown or lost, or is not computing ``portion``.
        """
        self._check_live(replica, "completed")
        if self._current.get(replica) != portion:
            raise ValueError(f"completed: replica {replica} was not assigned portion "
                             f"{portion!r} (it is computing {self._current.get(replica)})")
        del self._current[replica]
        self._drop_copy(portion, replica)
        if portion in self._accepted_by or portion in self._final:
            self.stats["duplicates"] += 1
            return False
        self._accepted_by[portion] = replica
        self._unflushed[replica].append(portion)
        self.stats["completed"][replica] += 1
        return True

    def flushed(self, replica: int) -> list[int]:
        """``replica`` pushed its accumulated gradients: its accepted portions become final.

        Returns
        -------
        list of int
            The portions that became final, ascending (empty if there were none).

        Raises
        ------
        ValueError
            If ``replica`` is unknown or lost.
        """
        self._check_live(replica, "flushed")
        done = sorted(self._unflushed[replica])
        self._unflushed[replica] = []
        for portion in done:
            del self._accepted_by[portion]
            self._final.add(portion)
        return done

    def lost(self, replica: int) -> list[int]:
        """``replica`` stopped answering: remove it and put its unfinished work back.

        Its accepted-but-unflushed portions and the portion it was computing return to the
        pool (to their home regions) as unassigned, except a portion that another replica has
        already completed or is still computing a copy of: that one stays with the other
        replica. ``replica`` never gets work again.

        Returns
        -------
        list of int
            The portions put back in the pool, ascending.

        Raises
        ------
        ValueError
            If ``replica`` is unknown or already lost.
        """
        self._check_live(replica, "lost")
        self._live.remove(replica)
        affected = self._unflushed.pop(replica)
        for portion in affected:
            del self._accepted_by[portion]
        if replica in self._current:
            portion = self._current.pop(replica)
            self._drop_copy(portion, replica)
            if portion not in self._accepted_by and portion not in self._final:
                affected.append(portion)
        requeued = []
        for portion in affected:
            if portion in self._copies:  # another replica is computing it: let it finish
                continue
            bisect.insort(self._pool[self._home[portion]], portion)
            requeued.append(portion)
        self.stats["requeued"] += len(requeued)
        return sorted(requeued)

    # -- helpers ---------------------------------------------------------------------------

    def _hand_out(self, replica: int, portion: int, now: float, backup: bool) -> int:
        self._current[replica] = portion
        self._copies.setdefault(portion, {})[replica] = now
        self.stats["assigned"] += 1
        if backup:
            self.stats["reissued"] += 1
        return portion

    def _drop_copy(self, portion: int, replica: int) -> None:
        copies = self._copies[portion]
        del copies[replica]
        if not copies:
            del self._copies[portion]

    def _check_live(self, replica: int, what: str) -> None:
        if replica not in self._live:
            state = "was lost" if replica in self._region_of else "is not a replica of this batch"
            raise ValueError(f"{what}: replica {replica!r} {state}")
