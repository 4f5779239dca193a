"""The one polling loop every server-like rank runs: probe, wait with back-off, dispatch on tag.

ps-lite keeps its server loop fixed and makes the request handler the plug-in; so does this:
a shard hands :func:`serve` a handler per :class:`~hpcps.mpi.protocol.Tag`, and the loop receives
nothing itself. A handler is called as ``handler(source, status)`` once a message with its tag
is waiting (the status holds its size); it receives the message and returns True to end the
loop. A tag with no handler is a protocol error, reported with its sender.

The loop polls (``Iprobe``) rather than blocking in ``Recv``, so that it can fail after
``timeout`` seconds without any message, naming what it still waits for, and between polls it
yields the core (:class:`~hpcps.mpi.comm.Poller`): ranks are often oversubscribed. An optional
``tick`` is called when the loop is idle and every ``TICK_EVERY`` messages, so a serving rank
still takes part in the job's stop vote (:mod:`hpcps.runtime.stop`) and notices silent peers; a tick
that returns True ends the loop (the last peer it waited for was lost).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping


from hpcps import trace
from hpcps.mpi.comm import (PeerGone, PeerTimeout, Poller, Transport, size_of, source_of, status,
                            tag_of)
from hpcps.mpi.protocol import tag_name

Handler = Callable[[int, Any], "bool | None"]  # (source, the probed status)
Tick = Callable[[], "bool | None"]
TICK_EVERY = 64  # messages between two ticks of a busy loop


def serve(comm, handlers: Mapping[int, Handler], timeout: float,
          waiting_for: Callable[[], str], tick: Tick | None = None,
          stalled: Callable[[float], None] | None = None, stall_s: float = 0.0) -> None:
    """Dispatch messages on ``comm`` to ``handlers[tag]`` until a handler returns True.

    Parameters
    ----------
    comm : the communicator to listen on (any source, any tag).
    handlers : ``{tag: handler(source, status)}``.
    timeout : seconds without any message before raising PeerTimeout.
    waiting_for : called for the timeout message: who and what the loop still waits for.
    tick : called when idle and every ``TICK_EVERY`` messages (cheap: it must not wait);
        returning True ends the loop.
    stalled : ``stalled(gap)``, called first when the loop itself did not come round for
        more than ``stall_s`` seconds (the rank was stopped, or starved of CPU): what it
        judges by silence must not count that time against the others.
    """
    net = Transport(comm)
    st = status()
    poll = Poller()
    last = time.monotonic()
    handled = 0
    came_round = last
    while True:
        if stalled is not None:
            now = time.monotonic()
            if now - came_round > stall_s:
                stalled(now - came_round)
                last = now  # nor is it this loop's own silence
            came_round = now
        if not net.probe(st):
            if tick is not None and tick():
                return
            if time.monotonic() - last > timeout:
                raise PeerTimeout(f"heard nothing for {timeout:.0f} s while waiting for "
                                  f"{waiting_for()}")
            poll.pause()
            continue
        poll.reset()
        last = time.monotonic()
        source, tag = source_of(st), tag_of(st)
        handler = handlers.get(tag)
        if handler is None:
            raise RuntimeError(f"unexpected message tag {tag} from rank {source}")
        tr = trace.ACTIVE
        t0, nbytes = (tr.now(), size_of(st)) if tr is not None else (0.0, 0)
        try:
            finished = handler(source, st)
        except PeerGone:  # (ULFM) its sender died before it was taken: lost with it; the
            continue  # sender is found dead by its silence, as without ULFM
        if tr is not None:  # the handler's time: receiving the message and acting on it
            tr.message(f"{tag_name(tag)} from rank {source}", nbytes, t0, source=source)
        if finished:
            return
        handled += 1
        if tick is not None and handled % TICK_EVERY == 0 and tick():
            return
