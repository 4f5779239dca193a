"""Replicated server shards (``--ps-copies C``): every chunk on C shard ranks, a primary that
applies and secondaries that follow, and a secondary that takes over when its primary dies
(Project Adam, section 3.3).

**Sets and holders.** The chunk plan (:mod:`hpcps.ps.chunks`) gives each of the S shards its
*home set* of chunks. Set ``h`` is held by shards ``h, h+1, ..., h+C-1`` (mod S), in that
order; the first of them alive is the set's *primary*, the others its *secondaries*. Every
shard is the primary of its own home set while it lives and a secondary of the C-1 sets
before it, so copies add the same load to every shard; when shard ``h`` dies, shard ``h+1``
serves set ``h`` besides its own. The rule needs no vote: every rank that agrees on which
shards are dead agrees on every primary (:func:`primary`).

**A push and its commit.** A replica sends its gradient slice for set ``h`` to the set's
primary with its push count ``SEQ`` (1, 2, ...). The primary applies it, forwards the message
as received to each live secondary (``REPLICATE``), which applies the same update to its copy
and answers ``REPL_ACK`` with the pushes its copy has applied. Every copy applies the same
pushes in the same order (one channel per primary-secondary pair, and MPI does not reorder
messages between two ranks) through the same deterministic policy (Downpour's, softsync or
SSP: :class:`.server.SetPolicy`), so the copies are equal. A push is **committed** once every
live secondary has acknowledged a count at or past it (counted in pushes, not updates: a
softsync group is one update); only then does the primary send ``PUSH_ACK`` to the replica.
A replica keeps each push until it is acknowledged, with at most two in flight per set.

**Failover.** Every shard sends every other shard a heartbeat 5 times per
``--heartbeat-timeout`` (from a thread of its own, as replicas do); a shard silent for the
timeout is dead to the shard that noticed. The first live holder of each of its sets becomes
the primary, tells every replica and shard (``NEW_PRIMARY``: the set, and which shard is dead)
and sends its copy, the policy's state included, to the set's other live holders
(``SET_STATE``), which replace theirs: a secondary may have applied a push the old primary
forwarded to it alone, which is not committed. A replica that hears ``NEW_PRIMARY`` sends its
waiting fetch and every push not yet acknowledged to the new primary. Copies remember each
replica's last ``SEQ`` applied, so a push the new primary already holds is acknowledged without
being applied again. So **no committed push is lost** (every live copy holds it), **none is
applied twice**, and an uncommitted one is sent again: at the end, each set has applied exactly
the pushes its replicas saw committed. A shard that hears it was declared dead leaves the run.

**The end.** A set's primary, once every replica has finished (or been lost) and every push
is committed, sends the set's final state to the chief (``FINAL_SET``). The chief keeps the
first copy of each set it receives (a primary that dies as it ends is followed by its
successor, which sends the set again) and, once it holds all S, tells every shard to leave
(``FINAL_DONE``). Nothing waits in a collective over the shards, so a dead shard blocks
nothing. Periodic checkpoints
(``--checkpoint-every``) go the same way: each set's primary sends its state at a boundary
to the *collector*, the live shard of lowest index, which writes the checkpoint once it holds
every set at that step (a boundary crossed while a set's primary died is skipped).

Losing every copy of a set ends the job with an error naming the set.

The package, by job: :mod:`.placement` (who holds which set, the state message's layout: pure,
no MPI), :mod:`.server` (a shard serving the sets it holds) and :mod:`.client` (a replica's
fetches and pushes, and the chief's taking of the final sets).
"""
from hpcps.ps.replicated.client import ReplicatedClient, receive_final
from hpcps.ps.replicated.placement import (assemble, collector, holders, primary, sets_of,
                                           state_size)
from hpcps.ps.replicated.server import ReplicatedServer, SetPolicy

__all__ = ["ReplicatedClient", "ReplicatedServer", "SetPolicy", "assemble", "collector",
           "holders", "primary", "receive_final", "sets_of", "state_size"]
