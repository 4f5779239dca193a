"""Pairwise covering arrays: few rows in which every pair of values of every two dimensions
appears at least once (all-pairs sampling of a product too large to run whole).

Pure and deterministic (no randomness: the same rows on every run and every machine); used by
``tests/test_combinations.py`` to sample the combination matrix. Rows are scored with NumPy
(each row's pairs as ids, the pairs left as a boolean vector), so a product of 10^5 rows takes
a second or two beyond judging them.

A plain covering array is blind to combinations the program refuses: a pair such as
``--partitions 2`` with ``--threads 2`` may then be "covered" only by a row that also holds a
pair the program refuses (``--push activations``), so it never trains. Given ``accept``,
:func:`pairwise` therefore covers every pair that some accepted row holds with accepted rows,
and the pairs that only refused rows hold (the refusals themselves) with refused rows.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np


def pairwise(dims: Sequence[Sequence],
             accept: Callable[[tuple], bool] | np.ndarray | None = None) -> list[tuple]:
    """Rows of values, one per dimension, covering every pair of values of two dimensions.

    Greedy set cover over the whole product: the next row is the one covering the most pairs
    not yet covered; among those, the one whose new pairs lie where most pairs are left (two
    dimensions of 3 values before two of 2), then the first in product order. Dimensions of
    one value are set aside while choosing (they only blur the scores) and put back after.
    With ``accept`` (a pure function of a row of values), accepted rows first cover every
    pair that some accepted row holds; then refused rows cover the rest, each holding as few
    refused pairs as possible (a refusal tested alone, not masked by another). Meant for
    products of up to a few 10^5 rows (each is scored, as NumPy arrays, at every pick).

    Parameters
    ----------
    dims : the values of each dimension; each needs at least one.
    accept : ``accept(row) -> bool``, whether the program under test accepts a row; or
        that verdict for every row at once, a boolean array in ``itertools.product(*dims)``
        order (faster for a large product); None: every row counts as accepted.

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
            full[k] = int(v)
        return tuple(dims[k][v] for k, v in enumerate(full))

    free_sizes = [sizes[k] for k in free]
    # the product's rows of value indices, in product order
    rows = np.indices(free_sizes, dtype=np.int32).reshape(len(free_sizes), -1).T
    # pair ids: dimension pair d = (i, j) owns ids base[d] .. base[d] + sizes[i] * sizes[j]
    dim_pairs = list(itertools.combinations(range(len(free_sizes)), 2))
    base = np.cumsum([0] + [free_sizes[i] * free_sizes[j] for i, j in dim_pairs])
    covers = np.empty((len(rows), len(dim_pairs)), dtype=np.int32)  # rows x dim pairs
    for d, (i, j) in enumerate(dim_pairs):
        covers[:, d] = base[d] + rows[:, i] * free_sizes[j] + rows[:, j]
    pair_dim = np.repeat(np.arange(len(dim_pairs)), np.diff(base))   # pair id -> dim pair
    if accept is None:
        ok = np.ones(len(rows), bool)
    elif callable(accept):
        ok = np.array([bool(accept(values(r))) for r in rows], dtype=bool)
    else:  # the product's order over every dimension is its order over the free ones
        ok = np.asarray(accept, dtype=bool).ravel()
        if ok.size != len(rows):
            raise ValueError(f"accept: {ok.size} verdicts for a product of {len(rows)} rows")
    feasible = np.zeros(base[-1], dtype=bool)
    feasible[covers[ok].ravel()] = True
    chosen: list[int] = []
    todo = feasible.copy()
    pool = np.flatnonzero(ok)
    weight_span = len(dim_pairs) * max(free_sizes) ** 2 + 1  # more than any row's weight
    while todo.any():
        left = np.bincount(pair_dim[todo], minlength=len(dim_pairs))
        new = todo[covers[pool]]                               # pool x dim pairs
        useful = new.any(axis=1)  # a row with no pair left to cover never will have one
        pool, new = pool[useful], new[useful]
        score = new @ (left + weight_span)  # new pairs, then where most are left
        best = int(pool[np.argmax(score)])  # argmax: the first, in product order, of the best
        chosen.append(best)
        todo[covers[best]] = False
    # Refused rows: one refusal masks another (the program reports the first it finds), so
    # each row holds as few refused pairs as it can, and covers as many as it can after that.
    # Only the refused pairs count here (few): each refused row's as a row of booleans.
    refused = np.flatnonzero(~feasible)
    column = np.full(base[-1], -1, dtype=np.int32)
    column[refused] = np.arange(len(refused))
    pool = np.flatnonzero(~ok)
    where = column[covers[pool]]                               # pool x dim pairs
    holds = np.zeros((len(pool), len(refused)), dtype=bool)   # pool x refused pairs
    at, d = np.nonzero(where >= 0)
    holds[at, where[at, d]] = True
    faults = holds.sum(axis=1)
    todo = np.ones(len(refused), dtype=bool)
    span = len(dim_pairs) + 1
    while todo.any():
        new = holds[:, todo].sum(axis=1)
        useful = new > 0  # a row with no pair left to cover never will have one
        pool, holds, faults, new = pool[useful], holds[useful], faults[useful], new[useful]
        k = int(np.argmax(-faults * span + new))
        chosen.append(int(pool[k]))
        todo[holds[k]] = False
    return [values(rows[k]) for k in chosen]
