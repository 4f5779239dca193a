import pytest

from hpcps.errors import ConfigError
from hpcps.mpi.topology import Layout, shard_range


@pytest.mark.parametrize("n,s,p", [(1, 0, 1), (2, 1, 1), (4, 1, 1), (5, 2, 1), (7, 1, 3),
                                   (9, 1, 4), (3, 0, 1)])
def test_layout_fits_and_roles_cover_every_rank(n, s, p):
    lay = Layout.plan(n, s, p)
    assert lay.servers + lay.replicas * lay.partitions == n
    roles = [lay.role(r) for r in range(n)]
    assert [r.kind for r in roles].count("server") == s
    assert sorted(r.shard for r in roles if r.is_server) == list(range(s))
    pairs = {(r.replica, r.partition) for r in roles if r.is_replica}
    assert pairs == {(a, b) for a in range(lay.replicas) for b in range(p)}
    assert roles[0].is_replica and roles[0].replica == 0  # rank 0 is always the chief replica
    for r in range(n):
        role = lay.role(r)
        if role.is_replica:
            assert lay.replica_rank(role.replica, role.partition) == r
        else:
            assert lay.server_rank(role.shard) == r


@pytest.mark.parametrize("n,s,p", [(1, 1, 1), (2, 2, 1), (4, 1, 2), (3, 3, 1), (6, 1, 4)])
def test_impossible_layout_names_n_s_p(n, s, p):
    with pytest.raises(ConfigError) as e:
        Layout.plan(n, s, p)
    msg = str(e.value)
    assert f"N={n}" in msg and f"S={s}" in msg and f"P={p}" in msg and "fit" in msg


def test_suggestion_is_a_valid_size():
    with pytest.raises(ConfigError, match=r"N = 2"):
        Layout.plan(1, 1, 1)


@pytest.mark.parametrize("n,shards", [(10, 1), (10, 3), (1000, 7), (5, 5)])
def test_shard_range_is_contiguous_and_balanced(n, shards):
    chunks = [shard_range(n, shards, s) for s in range(shards)]
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    sizes = [hi - lo for lo, hi in chunks]
    assert max(sizes) - min(sizes) <= 1


def test_more_shards_than_parameters_refused():
    with pytest.raises(ConfigError, match="fewer --servers"):
        shard_range(3, 4, 0)
