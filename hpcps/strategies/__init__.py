"""Training strategies. Each module has ``run(ctx) -> dict`` (see :mod:`.common`).

``downpour``  asynchronous replicas and a sharded parameter server (DistBelief).
``sync``      allreduce of gradients every step, no servers.
``deadreckon`` thresholded 1-bit weight deltas sent peer to peer, no servers (Strom).
``sandblaster`` batch L-BFGS run by a coordinator through the server shards (DistBelief).
"""
from hpcps.strategies import deadreckon, downpour, sandblaster, sync

STRATEGIES = {"downpour": downpour, "sync": sync, "deadreckon": deadreckon,
              "sandblaster": sandblaster}
NEEDS_SERVERS = {"downpour": True, "sync": False, "deadreckon": False, "sandblaster": True}
HAS_COORDINATOR = {"sandblaster"}
