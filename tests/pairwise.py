"""Pairwise covering arrays: few rows in which every pair of values of every two dimensions
appears at least once (all-pairs sampling of a product too large to run whole).

Pure and deterministic (no randomness: the same rows on every run and every machine); used by
``tests/test_matrix.py`` to sample the combination matrix.

A plain covering array is blind to combinations the program refuses: a pair such as
``--partitions 2`` with ``--threads 2`` may then be "covered" only by a row that also holds a
pair the program refuses (``--push activations``), so it never trains. Given ``accept``,
:func:`pairwise` therefore covers every pair that some accepted row holds with accepted rows,
and the pairs that only refused rows hold (the refusals themselves) with refused rows.
"""
from __future__ import annotations

import collections
import itertools
from typing import Callable, Sequence

Pair = tuple[int, int, int, int]  # (dimension i, value index a, dimension j > i, value index b)


def row_pairs(row: Sequence[int]) -> frozenset[Pair]:
    """The pairs a row of value indices covers."""
    return frozenset((i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2))


def all_pairs(sizes: Sequence[int]) -> set[Pair]:
    """Every pair of value indices of two dimensions with ``sizes[k]`` values each."""
    return {(i, a, j, b) for i, j in itertools.combinations(range(len(sizes)), 2)
            for a in range(sizes[i]) for b in range(sizes[j])}


def pairwise(dims: Sequence[Sequence], accept: Callable[[tuple], bool] | None = None
             ) -> list[tuple]:
    """Rows of values, one per dimension, covering every pair of values of two dimensions.

    Greedy set cover over the whole product: the next row is the one covering the most pairs
    not yet covered; among those, the one whose new pairs lie where most pairs are left (two
    dimensions of 3 values before two of 2), then the first in product order. Dimensions of
    one value are set aside while choosing (they only blur the scores) and put back after.
    With ``accept`` (a pure function of a row of values), accepted rows first cover every
    pair that some accepted row holds; then refused rows cover the rest, each holding as few
    refused pairs as possible (a refusal tested alone, not masked by another). Meant for
    products of up to about 10^5 rows (each is scored at every pick).

    Parameters
    ----------
    dims : the values of each dimension; each needs at least one.
    accept : ``accept(row) -> bool``, whether the program under test accepts a row;
        None: every row counts as accepted.

    Returns
    -------
    The chosen rows as tuples of values, accepted rows first.
    """
    sizes = [len(d) for d in dims]
    if any(n == 0 for n in sizes):
        raise ValueError("every dimension needs at least one value")
    free = [k for k, n in enumerate(sizes) if n > 1]
    if len(free) < 2:  # no pair to choose for: every value once is every pair
        free = list(range(len(dims)))
    if len(free) < 2:
        return [(v,) for v in dims[0]] if dims else []

    def values(row: Sequence[int]) -> tuple:
        full = [0] * len(dims)
        for k, v in zip(free, row):
            full[k] = v
        return tuple(dims[k][v] for k, v in enumerate(full))

    free_sizes = [sizes[k] for k in free]
    rows = list(itertools.product(*(range(n) for n in free_sizes)))
    covers = [row_pairs(r) for r in rows]
    ok = [True] * len(rows) if accept is None else [bool(accept(values(r))) for r in rows]
    feasible: set[Pair] = set()
    for k in range(len(rows)):
        if ok[k]:
            feasible |= covers[k]
    chosen: list[int] = []
    todo = set(feasible)
    pool = [k for k in range(len(rows)) if ok[k]]
    while todo:
        left = collections.Counter((i, j) for i, _, j, _ in todo)

        def gain(k: int) -> tuple[int, int, int]:
            new = covers[k] & todo
            return len(new), sum(left[i, j] for i, _, j, _ in new), -k
        best = max(pool, key=gain)
        chosen.append(best)
        todo -= covers[best]
    # Refused rows: one refusal masks another (the program reports the first it finds), so
    # each row holds as few refused pairs as it can, and covers as many as it can after that.
    todo = all_pairs(free_sizes) - feasible
    pool = [k for k in range(len(rows)) if not ok[k]]
    faults = {k: len(covers[k] - feasible) for k in pool}
    while todo:
        best = max((k for k in pool if covers[k] & todo),
                   key=lambda k: (-faults[k], len(covers[k] & todo), -k))
        chosen.append(best)
        todo -= covers[best]
    return [values(rows[k]) for k in chosen]
