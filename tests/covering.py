"""Pairwise covering arrays: a few rows in which every pair of values of every two dimensions
appears at least once. Pure and deterministic (the same rows on every run), used by the
combination test to sample a product too large to run whole.
"""
from __future__ import annotations

import itertools
from typing import Sequence


def pairs_of(dims: Sequence[Sequence]) -> set[tuple[int, int, int, int]]:
    """Every (dimension i, value index a, dimension j > i, value index b) to cover."""
    return {(i, a, j, b) for i, j in itertools.combinations(range(len(dims)), 2)
            for a in range(len(dims[i])) for b in range(len(dims[j]))}


def covered_by(row: Sequence[int]) -> set[tuple[int, int, int, int]]:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def pairwise(dims: Sequence[Sequence]) -> list[tuple]:
    """Rows of values, one per dimension, covering every pair of values (greedy, AETG-like).

    Each row starts from the first pair not yet covered and fills the other dimensions one
    by one with the value that covers the most new pairs with the values already chosen
    (ties: the lowest index). Every dimension needs at least one value.
    """
    if any(len(d) == 0 for d in dims):
        raise ValueError("every dimension needs at least one value")
    if len(dims) < 2:
        return [tuple(d[k] for d in dims) for k in range(len(dims[0]) if dims else 0)]
    todo = pairs_of(dims)
    rows: list[tuple[int, ...]] = []
    while todo:
        i, a, j, b = min(todo)
        row: list[int | None] = [None] * len(dims)
        row[i], row[j] = a, b
        for k in range(len(dims)):
            if row[k] is not None:
                continue
            best, gain = 0, -1
            for v in range(len(dims[k])):
                new = sum(1 for m, w in enumerate(row) if w is not None and
                          ((m, w, k, v) if m < k else (k, v, m, w)) in todo)
                if new > gain:
                    best, gain = v, new
            row[k] = best
        todo -= covered_by(row)
        rows.append(tuple(row))
    return [tuple(dims[k][v] for k, v in enumerate(r)) for r in rows]
