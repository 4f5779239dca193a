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
    n_rows = int(np.prod(free_sizes))
    # pair ids: dimension pair d = (i, j) owns ids base[d] .. base[d] + sizes[i] * sizes[j]
    dim_pairs = list(itertools.combinations(range(len(free_sizes)), 2))
    base = np.cumsum([0] + [free_sizes[i] * free_sizes[j] for i, j in dim_pairs])
    pair_dim = np.repeat(np.arange(len(dim_pairs)), np.diff(base))   # pair id -> dim pair

    def row_of(k: int) -> np.ndarray:
        """The value indices (free dimensions) of row ``k`` in product order."""
        return np.array(np.unravel_index(k, free_sizes), dtype=np.int64)

    def covers_of(ks: np.ndarray, pairs=range(len(dim_pairs))) -> np.ndarray:
        """The pair ids of rows ``ks`` (product order) in dimension pairs ``pairs``, rows x
        pairs."""
        idx = np.unravel_index(ks, free_sizes)
        out = np.empty((len(ks), len(pairs)), dtype=np.int32)
        for c, d in enumerate(pairs):
            i, j = dim_pairs[d]
            out[:, c] = base[d] + idx[i] * free_sizes[j] + idx[j]
        return out

    if accept is None:
        ok = np.ones(n_rows, bool)
    elif callable(accept):
        ok = np.array([bool(accept(values(row_of(k)))) for k in range(n_rows)], dtype=bool)
    else:  # the product's order over every dimension is its order over the free ones
        ok = np.asarray(accept, dtype=bool).ravel()
        if ok.size != n_rows:
            raise ValueError(f"accept: {ok.size} verdicts for a product of {n_rows} rows")
    pool = np.flatnonzero(ok)
    covers = covers_of(pool)                                   # pool x dim pairs
    feasible = np.zeros(base[-1], dtype=bool)
    feasible[covers.ravel()] = True
    chosen: list[int] = []
    todo = feasible.copy()
    weight_span = len(dim_pairs) * max(free_sizes) ** 2 + 1  # more than any row's weight
    active = np.arange(len(dim_pairs))  # the dimension pairs with pairs left, covers' columns
    while todo.any():
        left = np.bincount(pair_dim[todo], minlength=len(dim_pairs))
        if np.count_nonzero(left[active]) < len(active):  # a dimension pair is done: its column
            keep = left[active] > 0                        # can cover nothing more
            active, covers = active[keep], covers[:, keep]
        new = todo[covers]                                     # pool x active dim pairs
        useful = new.any(axis=1)  # a row with no pair left to cover never will have one
        pool, covers, new = pool[useful], covers[useful], new[useful]
        # new pairs, then where most are left; integers below 2^24, so float32 is exact
        score = new.astype(np.float32) @ (left[active] + weight_span).astype(np.float32)
        k = int(np.argmax(score))  # argmax: the first, in product order, of the best
        chosen.append(int(pool[k]))
        todo[covers[k]] = False
    # Refused rows: one refusal masks another (the program reports the first it finds), so
    # each row holds as few refused pairs as it can, and covers as many as it can after that.
    # Only the refused pairs count here (few): each refused row's as a row of booleans.
    # Rows are taken fewest refused pairs first, so only the rows at the lowest count that can
    # still cover something are scored at each pick.
    refused = np.flatnonzero(~feasible)
    column = np.full(base[-1], -1, dtype=np.int32)
    column[refused] = np.arange(len(refused))
    pool = np.flatnonzero(~ok)
    pairs = np.unique(pair_dim[refused])  # the dimension pairs that hold refused pairs
    holds = np.zeros((len(pool), len(refused)), dtype=bool)   # pool x refused pairs
    for lo in range(0, len(pool), 1 << 16):  # in blocks: the pool may hold millions of rows
        where = column[covers_of(pool[lo:lo + (1 << 16)], pairs)]
        at, d = np.nonzero(where >= 0)
        holds[lo + at, where[at, d]] = True
    faults = holds.sum(axis=1)
    levels = {f: np.flatnonzero(faults == f) for f in np.unique(faults[faults > 0])}
    todo = np.ones(len(refused), dtype=bool)
    while todo.any():
        for f, at in levels.items():  # ascending
            new = holds[at][:, todo].sum(axis=1)
            at, new = at[new > 0], new[new > 0]  # a row with no pair left never will have one
            levels[f] = at
            if len(at):
                k = int(at[np.argmax(new)])  # the first, in product order, of the most new
                break
        else:  # every refused pair is held by some refused row: this cannot happen
            raise AssertionError("a refused pair that no refused row holds")
        chosen.append(int(pool[k]))
        todo[holds[k]] = False
    return [values(row_of(k)) for k in chosen]
