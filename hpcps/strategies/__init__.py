"""Training strategies, one module each, found by :mod:`.registry` (each exports ``STRATEGY``).

``downpour``    asynchronous replicas and a sharded parameter server (DistBelief).
``sync``        allreduce of gradients every step, no servers.
``deadreckon``  thresholded 1-bit weight deltas sent peer to peer, no servers (Strom).
``sandblaster`` batch L-BFGS run by a coordinator through the server shards (DistBelief).

Shared pieces: :mod:`.registry` (what a strategy declares), :mod:`.context` (what every role
is handed; checkpoints, evaluation), :mod:`.loop` (the replica loop of the SGD strategies),
:mod:`.gradients` (a replica's gradient: compiled engine, NumPy or Hogwild threads).
"""
