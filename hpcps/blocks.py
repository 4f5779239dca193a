"""Splitting ``n`` items into ``parts`` contiguous blocks: the one rule every split in hpcps uses.

Data shards, parameter shards, a layer's neurons across model partitions, a batch's portions
across replicas and the examples of one pass across Hogwild threads are all cut the same way:

    block ``i`` of ``n`` items in ``parts`` blocks is the half-open range ``[lo, hi)``; the
    blocks tile ``0 .. n`` in order, their sizes differ by at most one, and the first
    ``n % parts`` blocks are the larger ones (``n // parts + 1`` items, the rest ``n // parts``).

This is ``np.array_split``'s rounding, and Heat's ``counts_displs_shape`` and mpi4py-fft's
``_blockdist`` compute the same thing. The functions are pure (no MPI, nothing but integer
arithmetic), so any rank computes any other rank's block without communicating, and the rule
is tested on its own (``tests/test_blocks.py``). :func:`counts_displs` gives the counts and
displacements that ``Gatherv``/``Allgatherv``/``Scatterv`` take.
"""
from __future__ import annotations

from numbers import Integral
from typing import Sequence


def _check_int(func: str, arg_name: str, value: object) -> None:
    # bool is an int subclass, but True blocks is a bug, not a count. (NumPy's integers are
    # Integral: no NumPy import, which the start-up checks do without.)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{func}: {arg_name} must be an int, got {value!r}")


def _check_split(func: str, n: int, parts: int) -> None:
    _check_int(func, "n", n)
    _check_int(func, "parts", parts)
    if n < 0:
        raise ValueError(f"{func}: n must be >= 0, got {n}")
    if parts < 1:
        raise ValueError(f"{func}: parts must be >= 1, got {parts}")


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Items ``lo:hi`` of block ``index`` when ``n`` items are split into ``parts`` blocks.

    Parameters
    ----------
    n : int
        Number of items, >= 0.
    parts : int
        Number of blocks, >= 1. ``parts > n`` is allowed: the last blocks are then empty
        (``lo == hi``); callers that cannot work with an empty block refuse it themselves.
    index : int
        Which block, ``0 <= index < parts``.

    Returns
    -------
    (lo, hi) : tuple of int
        Half-open range; ``hi - lo`` is ``n // parts + 1`` for ``index < n % parts``, else
        ``n // parts``.

    Raises
    ------
    ValueError
        On a non-integer argument, a negative ``n``, ``parts < 1`` or ``index`` outside
        ``0 .. parts-1``.
    """
    _check_split("block_range", n, parts)
    _check_int("block_range", "index", index)
    if not 0 <= index < parts:
        raise ValueError(f"block_range: index must be in 0..{parts - 1}, got {index}")
    base, extra = divmod(int(n), int(parts))
    index = int(index)
    lo = index * base + min(index, extra)
    hi = lo + base + (1 if index < extra else 0)
    return lo, hi


def block_counts(n: int, parts: int) -> list[int]:
    """Sizes of all ``parts`` blocks of ``n`` items, in block order (see :func:`block_range`).

    Raises
    ------
    ValueError
        As :func:`block_range`.
    """
    _check_split("block_counts", n, parts)
    base, extra = divmod(int(n), int(parts))
    return [base + 1] * extra + [base] * (int(parts) - extra)


def displacements(counts: Sequence[int]) -> list[int]:
    """Offset of each block when blocks of the given sizes are laid end to end.

    ``displacements([3, 3, 2]) == [0, 3, 6]``: the ``displs`` argument of the ``v``
    collectives for any list of counts, balanced or not.

    Raises
    ------
    ValueError
        On a negative or non-integer count.
    """
    displs, offset = [], 0
    for i, count in enumerate(counts):
        _check_int("displacements", f"counts[{i}]", count)
        if count < 0:
            raise ValueError(f"displacements: counts[{i}] must be >= 0, got {count}")
        displs.append(offset)
        offset += int(count)
    return displs


def counts_displs(n: int, parts: int) -> tuple[list[int], list[int]]:
    """Counts and displacements of the ``parts`` blocks of ``n`` items, for ``*v`` collectives.

    ``counts[i], displs[i]`` is ``hi - lo, lo`` of ``block_range(n, parts, i)``.

    Raises
    ------
    ValueError
        As :func:`block_range`.
    """
    _check_split("counts_displs", n, parts)
    counts = block_counts(n, parts)
    return counts, displacements(counts)
