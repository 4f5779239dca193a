"""Training strategies. Each module has ``run(ctx) -> dict`` (see :mod:`.common`).

``downpour``  asynchronous replicas and a sharded parameter server (DistBelief).
``sync``      allreduce of gradients every step, no servers.
``deadreckon`` thresholded 1-bit weight deltas sent peer to peer, no servers (Strom).
"""
from hpcps.strategies import deadreckon, downpour, sync

STRATEGIES = {"downpour": downpour, "sync": sync, "deadreckon": deadreckon}
NEEDS_SERVERS = {"downpour": True, "sync": False, "deadreckon": False}
