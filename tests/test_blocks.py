"""Serial tests of hpcps.blocks: the one rule by which hpcps splits n items into blocks."""

import numpy as np
import pytest

from hpcps.blocks import block_counts, block_range, counts_displs, displacements

SIZES = range(0, 201)
PARTS = range(1, 18)


def test_blocks_tile_exactly_balanced_larger_first():
    for n in SIZES:
        for parts in PARTS:
            blocks = [block_range(n, parts, i) for i in range(parts)]
            assert blocks[0][0] == 0 and blocks[-1][1] == n, (n, parts)
            for (_, hi), (lo, _) in zip(blocks, blocks[1:]):
                assert hi == lo, (n, parts)  # contiguous: no gap, no overlap
            sizes = [hi - lo for lo, hi in blocks]
            assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, (n, parts)
            assert sizes == sorted(sizes, reverse=True), (n, parts)  # larger blocks first


def test_counts_and_displs_agree_with_block_range():
    for n in SIZES:
        for parts in PARTS:
            blocks = [block_range(n, parts, i) for i in range(parts)]
            counts, displs = counts_displs(n, parts)
            assert counts == block_counts(n, parts) == [hi - lo for lo, hi in blocks]
            assert displs == [lo for lo, _ in blocks]
            assert all(type(v) is int for v in counts + displs)


def test_same_rounding_as_numpy_array_split():
    # hogwild's reference path used np.array_split; its parts must not have moved.
    for n in (0, 1, 7, 100, 101):
        for parts in (1, 2, 3, 8):
            order = np.arange(n)
            split = [order[slice(*block_range(n, parts, t))] for t in range(parts)]
            for ours, numpys in zip(split, np.array_split(order, parts), strict=True):
                np.testing.assert_array_equal(ours, numpys)


def test_more_parts_than_items_gives_empty_tail_blocks():
    assert [block_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert counts_displs(2, 4) == ([1, 1, 0, 0], [0, 1, 2, 2])


def test_numpy_integers_are_accepted():
    assert block_range(np.int64(10), np.int32(3), np.int64(2)) == (7, 10)
    assert block_counts(np.int64(10), np.int64(3)) == [4, 3, 3]


def test_displacements_of_uneven_counts():
    assert displacements([3, 0, 5, 2]) == [0, 3, 3, 8]
    assert displacements([]) == []


@pytest.mark.parametrize("args", [(-1, 2, 0), (5, 0, 0), (5, 2, 2), (5, 2, -1), (5.0, 2, 0),
                                  (5, True, 0), (5, 2, 1.0), ("5", 2, 0)])
def test_block_range_refuses_bad_arguments(args):
    with pytest.raises(ValueError, match="block_range"):
        block_range(*args)


@pytest.mark.parametrize("func", [block_counts, counts_displs])
@pytest.mark.parametrize("args", [(-1, 2), (5, 0), (5, -3), (5.0, 2), (5, 2.0), (True, 2),
                                  (5, None)])
def test_counts_refuse_bad_arguments(func, args):
    with pytest.raises(ValueError, match=func.__name__):
        func(*args)


@pytest.mark.parametrize("counts", [[1, -1], [1.0, 2], [True]])
def test_displacements_refuses_bad_counts(counts):
    with pytest.raises(ValueError, match="displacements"):
        displacements(counts)
