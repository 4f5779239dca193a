"""Training strategies. Each module has ``run(ctx) -> dict`` (see :mod:`.common`).

``downpour``  asynchronous replicas and a sharded parameter server (DistBelief).
``sync``      allreduce of gradients every step, no servers.
"""
from hpcps.strategies import downpour, sync

STRATEGIES = {"downpour": downpour, "sync": sync}
NEEDS_SERVERS = {"downpour": True, "sync": False}
