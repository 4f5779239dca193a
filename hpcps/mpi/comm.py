"""Communication helpers every role uses: timed waits, gathers, communicator copies, and the
exchange inside a model-parallel replica. Nothing here is specific to parameter servers.

Every wait in hpcps goes through :func:`wait_all`: it polls the requests, yields the core
between polls (ranks are often oversubscribed, and a rank spinning in MPI steals the CPU the
rank it waits for needs; where each rank has a core of its own, waits for a prompt reply
spin first: :func:`dedicate`), and after ``timeout`` seconds raises :class:`PeerTimeout`
naming what, and which rank, it waited for. Collectives here are the non-blocking ones,
waited on that way, so a missing rank ends the job with a message instead of a hang.

Point-to-point traffic of the parameter server goes through :class:`Transport`: one method per
kind of transfer (a probed message taken, a receive posted, an eager send, a tracked send, a
transfer given up at a deadline), so a shard or a client reads as messages, and every wait on
a peer that may be dead is bounded here, by :func:`finished_by` or :func:`wait_until`.
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np
from mpi4py import MPI

from hpcps import trace
from hpcps.blocks import block_counts, displacements
from hpcps.compress import bf16
from hpcps.compress.bf16 import FP32, Wire
from hpcps.errors import HpcpsError
from hpcps.mpi.protocol import Tag, tag_name


# Reduction operations and wildcards, so that the layers above name them without mpi4py.
SUM, MAX, LAND = MPI.SUM, MPI.MAX, MPI.LAND
ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG
REQUEST_NULL = MPI.REQUEST_NULL  # a request with nothing to wait for


def _peer_failure_classes() -> frozenset:
    """The error classes by which an MPI with ULFM (Open MPI 5 under ``mpirun --with-ft
    ulfm``) reports a dead peer; empty where the MPI has none of its own (mpi4py then gives
    these names a generic class, which must not be taken for a dead peer)."""
    generic = {MPI.ERR_UNKNOWN, MPI.ERR_OTHER, MPI.ERR_INTERN}
    found = (getattr(MPI, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                             "ERR_REVOKED"))
    return frozenset(c for c in found if c is not None and c not in generic)


PEER_FAILURE = _peer_failure_classes()


def peer_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI reporting that a peer died (ULFM's ``MPI_ERR_PROC_FAILED``)."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in PEER_FAILURE


def sender_vanished(exc: BaseException) -> bool:
    """Whether ``exc`` is MPICH failing a receive because its sender's process is gone: on
    one node MPICH copies a large message straight from the sender's memory
    (``process_vm_readv``), which fails with ESRCH once the sender has died. Without ULFM
    this error, raised at once, is the only sign MPI gives of the death (other transfers
    with a dead rank stay pending)."""
    return isinstance(exc, MPI.Exception) and "process_vm_readv failed (errno 3)" in str(exc)


class PeerTimeout(HpcpsError):
    """Another rank did not answer in time. ``lost``: the world ranks the raiser already
    knows are gone (shards found dead, replicas dropped): the stack dump that explains the
    failure (:mod:`hpcps.runtime.stacks`) does not wait for theirs."""

    exit_code = 5

    def __init__(self, *args, lost=()):
        super().__init__(*args)
        self.lost = tuple(sorted(set(lost)))


class PeerFailed(PeerTimeout):
    """MPI reported a rank waited on dead (ULFM): the survivors may shrink the communicator
    (:func:`shrink`) and go on."""


class PeerDied(PeerFailed):
    """A rank died while this one received its message, and MPI said so (without ULFM:
    :func:`sender_vanished`). Where nothing survives a death (no ``--heartbeat-timeout``),
    the job ends with this message and the dead rank's number instead of MPI's error stack."""

    def __init__(self, src: int, tag: int):
        name = tag_name(tag)
        super().__init__(f"rank {src} died while this rank received its {name} message (MPI "
                         "could not copy it from that process: process_vm_readv, no such "
                         f"process): rank {src} was killed or ran out of memory",
                         lost=(src,))
        self.src = src


class PeerGone(Exception):
    """A message already probed could not be taken: ULFM reports its sender dead (Open MPI
    fails a receive from a dead rank even when the message has arrived whole). The message
    is lost with its sender; the loops that dispatch messages drop it and go on, and the
    sender is found dead as any silent peer is."""

    def __init__(self, src: int, tag: int):
        super().__init__(f"rank {src} died before its message (tag {tag}) was taken")
        self.src = src
        self.tag = tag


class Poller:
    """Back-off between polls: yield at first, then sleep a little longer each idle round.

    ``spin_s``: yield (never sleep) for this many seconds first. MPI moves a non-blocking
    collective on only inside MPI calls (MPICH's shared memory a cell of a large
    ``Ialltoallv`` per call): the averaging replica's bfloat16 round on 2 ranks ran 6x slower
    polled once a millisecond than polled at once. The large collectives use it
    (:class:`SumAllreduce`, :class:`ReplicaExchange`)."""

    def __init__(self, spin_s: float = 0.0):
        self.idle = 0
        self.spin_until = time.monotonic() + spin_s if spin_s > 0 else 0.0

    def reset(self) -> None:
        self.idle = 0

    def pause(self) -> None:
        self.idle += 1
        if self.idle < 200 or (self.spin_until and time.monotonic() < self.spin_until):
            os.sched_yield()
        else:
            time.sleep(min(1e-3, 1e-5 * (self.idle - 199)))


def _testall(reqs, what: str) -> bool:
    statuses = [MPI.Status() for _ in reqs]
    try:
        return MPI.Request.Testall(reqs, statuses)
    except MPI.Exception as exc:
        # a request's own error is in its status when Testall reports ERR_IN_STATUS
        errors = [exc] if exc.Get_error_class() != MPI.ERR_IN_STATUS else \
            [MPI.Exception(st.Get_error()) for st in statuses if st.Get_error() != MPI.SUCCESS]
        failed = [e for e in errors if peer_failed(e)]
        if failed:
            raise PeerFailed(f"{what}: MPI reports that a rank it waited on died "
                             f"({failed[0].Get_error_string()})") from None
        if any(sender_vanished(e) for e in errors):
            raise PeerFailed(f"{what}: a rank it received from died half-way (MPI could not "
                             "copy from that process: process_vm_readv, no such process)"
                             ) from None
        raise


def wait_all(reqs, timeout: float, what: str, spin_s: float = 0.0) -> None:
    """Complete every request in ``reqs`` or raise PeerTimeout after ``timeout`` seconds (at
    once where MPI reports the rank waited on dead: ULFM); ``spin_s``: :class:`Poller`'s."""
    if _testall(reqs, what):
        return
    tr = trace.ACTIVE
    t0 = tr.now() if tr is not None else 0
    deadline = time.monotonic() + timeout
    poll = Poller(spin_s)
    while not _testall(reqs, what):
        if time.monotonic() > deadline:
            raise PeerTimeout(f"waited {timeout:.0f} s for {what}; that rank is stuck or dead "
                              "(raise --timeout if it is only slow)")
        poll.pause()
    if tr is not None:
        tr.span(trace.WAIT, what, t0)


def wait_until(ready, timeout: float, what, events=None, since: float | None = None,
               spin_s: float = 0.0) -> None:
    """Poll ``ready()`` until it is true; raise PeerTimeout ``timeout`` seconds after
    ``since`` (``time.monotonic``; default now).

    ``what()`` names the peer and the message waited for (called only on a timeout).
    ``events()``, if given, is called between polls to take other messages; when it returns
    True (progress: a peer was replaced) the timeout starts again. ``spin_s``:
    :class:`Poller`'s.
    """
    deadline = (time.monotonic() if since is None else since) + timeout
    poll = Poller(spin_s)
    while not ready():
        if events is not None and events():
            deadline = time.monotonic() + timeout
            continue
        if time.monotonic() > deadline:
            raise PeerTimeout(f"waited {timeout:.0f} s for {what()} (raise --timeout if it is "
                              "only slow)")
        poll.pause()


def finished_by(req, deadline: float) -> bool:
    """Wait for ``req`` until ``deadline`` (``time.monotonic``); False if it did not finish
    or failed.

    MPICH reports some transfers from a dead rank as errors (a large message copied straight
    from the sender's memory: ``process_vm_readv`` fails), and leaves others pending forever.
    Either way the transfer is given up: a request left pending must not have its buffer
    used again (the caller replaces it), since MPI may still write into or read from it."""
    poll = Poller()
    try:
        while not req.Test():
            if time.monotonic() > deadline:
                return False
            poll.pause()
    except MPI.Exception:
        return False
    return True


_GIVEN_UP: list = []  # (request, buffer) of transfers given up before MPI finished them


def abandon(req, buf) -> None:
    """Stop waiting for ``req`` but keep ``buf`` alive until MPI is done with it.

    A transfer given up on (its peer found dead) may still happen: a peer that was only
    stopped or starved takes a send later, straight from this memory (MPICH copies large
    messages from the sender's pages, ``process_vm_readv``), and a receive may still be
    written into. Freed and reused, the buffer would send, or be overwritten with, another
    message's bytes. So every buffer given up stays referenced here until its request has
    completed or failed (checked each time another is given up)."""
    _GIVEN_UP[:] = [(r, b) for r, b in _GIVEN_UP if test(r) is False]
    if req != MPI.REQUEST_NULL and test(req) is False:
        _GIVEN_UP.append((req, buf))


def can_shrink() -> bool:
    """Whether this MPI drops dead ranks from a communicator (ULFM's ``MPI_Comm_shrink``:
    Open MPI 5 under ``mpirun --with-ft ulfm``)."""
    return bool(PEER_FAILURE) and hasattr(MPI.Comm, "Shrink")


def shrink(comms: list) -> list:
    """The survivors' copies of ``comms`` after a rank died (ULFM). Each is revoked first,
    so that every survivor's pending and next call on it fails and brings it here too, then
    shrunk to its live ranks (their order kept). Collective over the survivors of each, in
    the order given: every survivor passes the same list."""
    for comm in comms:
        try:
            comm.Revoke()
        except MPI.Exception:
            pass  # revoked already, by another survivor
    return [comm.Shrink() for comm in comms]


def lost_members(old, new) -> list[int]:
    """Ranks of ``old`` that its shrunk copy ``new`` no longer holds."""
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                     old.Get_group())
    return sorted(set(range(old.Get_size())) - set(kept))


def test(req) -> bool | None:
    """Whether a request has completed (a null request has): True, False while pending, None
    if it failed (MPICH fails some transfers with a dead rank)."""
    if req == MPI.REQUEST_NULL:
        return True
    try:
        return bool(req.Test())
    except MPI.Exception:
        return None


def all_done(reqs) -> bool:
    """Whether every request of ``reqs`` has completed (never waits)."""
    return bool(MPI.Request.Testall(reqs))


def status():
    """A fresh status for :meth:`Transport.probe` to fill."""
    return MPI.Status()


def source_of(st) -> int:
    return st.Get_source()


def tag_of(st) -> int:
    return st.Get_tag()


def size_of(st) -> int:
    """Bytes of the probed message ``st`` describes."""
    return st.Get_count(MPI.BYTE)


def done(req) -> bool:
    """Whether a request has completed (a null request has); a failure counts as not."""
    return test(req) is True


class Transport:
    """Point-to-point messages over one communicator, named by what they do.

    Buffers are the caller's (preallocated :class:`~hpcps.mpi.protocol.Message` views); this
    class owns no state but the communicator, so a shard and its helpers may share one.

    A dead peer. Without ULFM, MPI says nothing: a send to it may go (eagerly) or wait, a
    receive from it stays pending, and the roles find the peer by its silence (heartbeats,
    :mod:`hpcps.ps.liveness`). Under ULFM (Open MPI's ``mpirun --with-ft ulfm``) MPI raises
    ``MPI_ERR_PROC_FAILED`` instead, from the probe of any source until the failure is
    acknowledged and from every transfer with the dead rank; here that error becomes the
    silence the roles already handle: the failure is acknowledged (``MPI_Comm_ack_failed``,
    so probes go on), a send to the dead rank is dropped as sent, and a receive from it is
    one that never completes (given up at its deadline, or cancelled when the client
    re-routes); a message probed whose sender dies before it is taken is lost with it
    (:class:`PeerGone`, which the serving loop drops). Any other MPI error is raised.
    """

    def __init__(self, comm):
        self.comm = comm

    def _peer_failed(self, exc: BaseException) -> None:
        """ULFM reported a dead peer: acknowledge it (re-raise any other error)."""
        if not peer_failed(exc):
            raise exc
        try:
            self.comm.Ack_failed()
        except MPI.Exception:
            pass  # acknowledged already, or by another thread at the same time

    def _never(self):
        """A receive that never completes (from this rank, with a tag no message carries):
        what a receive from a dead peer is without ULFM. Cancelled like any other."""
        return self.comm.Irecv(bytearray(1), source=self.comm.Get_rank(), tag=Tag.NEVER)

    def probe(self, status, tag: int = MPI.ANY_TAG, source: int = MPI.ANY_SOURCE) -> bool:
        """Whether a message with ``tag`` from ``source`` is waiting (``status`` describes it)."""
        try:
            return self.comm.Iprobe(source, tag, status)
        except MPI.Exception as exc:
            self._peer_failed(exc)
            return False

    def take(self, buf, src: int, tag: int) -> None:
        """Receive a message already probed: it has arrived whole in MPI's eager buffer or is
        being sent, so this blocking receive waits on no decision of the peer. Raises
        :class:`PeerGone` if ULFM reports the sender dead meanwhile."""
        try:
            self.comm.Recv(buf, source=src, tag=tag)
        except MPI.Exception as exc:
            if sender_vanished(exc):
                raise PeerDied(src, tag) from None
            self._peer_failed(exc)
            raise PeerGone(src, tag) from None

    def taken(self, buf, src: int, tag: int) -> bool:
        """:meth:`take`, or False if ULFM reports the sender dead first (the message is lost
        with it): for loops that take what they probe outside :func:`hpcps.ps.serve.serve`."""
        try:
            self.take(buf, src, tag)
        except PeerGone:
            return False
        return True

    def _by(self, start, buf, deadline: float) -> bool:
        """Start a transfer of ``buf`` (``start()``, an Isend or Irecv) and wait for it until
        ``deadline``: False if MPI reports the peer dead or the deadline passes (then
        :func:`abandon` keeps ``buf`` for MPI, and the caller must not use it again)."""
        try:
            req = start()
        except MPI.Exception as exc:
            self._peer_failed(exc)
            return False
        if finished_by(req, deadline):
            return True
        abandon(req, buf)
        return False

    def take_by(self, buf, src: int, tag: int, deadline: float) -> bool:
        """Receive a probed message unless its sender dies half-way: False once ``deadline``
        passes (then ``buf`` may still be written to: the caller replaces it)."""
        return self._by(lambda: self.comm.Irecv(buf, source=src, tag=tag), buf, deadline)

    def post_recv(self, buf, src: int, tag: int):
        """Post a receive for a message asked for; returns the request to wait on."""
        try:
            return self.comm.Irecv(buf, source=src, tag=tag)
        except MPI.Exception as exc:
            self._peer_failed(exc)
            return self._never()

    def cancel(self, req, deadline: float, buf=None) -> bool:
        """Cancel a posted receive into ``buf``; False if MPI has not let it go by
        ``deadline`` (then the buffer may still be written to: the caller replaces it, and
        :func:`abandon` keeps the old one alive)."""
        req.Cancel()
        if finished_by(req, deadline):
            return True
        abandon(req, buf)
        return False

    def _send(self, buf, dest: int, tag: int) -> None:
        try:
            self.comm.Send(buf, dest=dest, tag=tag)
        except MPI.Exception as exc:
            self._peer_failed(exc)  # to a dead rank: dropped

    def send_eager(self, buf, dest: int, tag: int) -> None:
        """Send a header-only message (it goes eagerly: it does not wait for ``dest``, even a
        dead one, as long as few are sent to it: MPICH's shared-memory queue to a rank holds
        about 64, and a send to a dead rank whose queue is full waits forever), or a reply to
        a peer that posted its receive before asking."""
        self._send(buf, dest, tag)

    def send_nowait(self, buf, dest: int, tag: int):
        """Start a send; returns the request. ``buf`` must stay untouched until it completes."""
        try:
            return self.comm.Isend(buf, dest=dest, tag=tag)
        except MPI.Exception as exc:
            self._peer_failed(exc)
            return MPI.REQUEST_NULL  # to a dead rank: dropped, as sent

    def send(self, buf, dest: int, tag: int) -> None:
        """Send and return once ``buf`` may be reused: at once for a small message, once the
        receiver has matched it for a large one (a peer that serves requests in a loop)."""
        self._send(buf, dest, tag)

    def send_obj(self, obj, dest: int, tag: int) -> None:
        """Send a small Python object (pickled; control messages, not data)."""
        try:
            self.comm.send(obj, dest=dest, tag=tag)
        except MPI.Exception as exc:
            self._peer_failed(exc)

    def send_obj_nowait(self, obj, dest: int, tag: int):
        """Start sending a small Python object; returns the request (pickled by mpi4py,
        which keeps the pickle alive until it completes)."""
        try:
            return self.comm.isend(obj, dest=dest, tag=tag)
        except MPI.Exception as exc:
            self._peer_failed(exc)
            return MPI.REQUEST_NULL

    def take_obj(self, src: int, tag: int):
        """Receive a small Python object already probed."""
        return self.comm.recv(source=src, tag=tag)

    def post_recv_obj(self, src: int, tag: int):
        """Post the receive of a small Python object; ``test_obj`` of the request tells
        whether it has come and what it is."""
        return self.comm.irecv(source=src, tag=tag)

    def send_by(self, buf, dest: int, tag: int, deadline: float) -> bool:
        """Send, giving up at ``deadline`` (``dest`` died): False then, and ``buf`` must not be
        reused."""
        return self._by(lambda: self.comm.Isend(buf, dest=dest, tag=tag), buf, deadline)


def test_obj(req) -> tuple[bool, object]:
    """(True, the object) once a :meth:`Transport.post_recv_obj` request has completed,
    else (False, None)."""
    return req.test()


def start_allreduce(comm, send, recv, op):
    """Start a non-blocking reduction of ``send`` into ``recv``; returns the request (test it
    with :func:`test`, wait with :func:`wait_all`)."""
    return comm.Iallreduce(send, recv, op=op)


# Control data (small pickled objects) at points every rank of ``comm`` reaches together: the
# start-up vote, the final figures after a timed barrier. Blocking, by MPI's own collectives.
def allgather_obj(comm, obj) -> list:
    return comm.allgather(obj)


def bcast_obj(comm, obj, root: int = 0):
    return comm.bcast(obj, root=root)


def gather_obj(comm, obj, root: int = 0) -> list | None:
    return comm.gather(obj, root=root)


def reduce_obj(comm, obj, op, root: int = 0):
    return comm.reduce(obj, op=op, root=root)


def allreduce_obj(comm, obj, op):
    return comm.allreduce(obj, op=op)


def gather_bytes(comm, data: np.ndarray, timeout: float, what: str,
                 root: int = 0) -> list[bytes] | None:
    """Every rank's uint8 buffer (of any length) on ``root``, in rank order (None elsewhere).
    Collective over ``comm``; each of its two steps fails after ``timeout`` seconds."""
    size = comm.Get_size()
    counts = np.zeros(size, dtype=np.int64)
    wait_all([comm.Igather(np.array([len(data)], np.int64), counts, root=root)], timeout,
             f"{what} (sizes)")
    mine = comm.Get_rank() == root
    counts_l = [int(c) for c in counts]
    out = np.empty(sum(counts_l), dtype=np.uint8) if mine else None
    recv = [out, counts_l, displacements(counts_l), MPI.BYTE] if mine else None
    wait_all([comm.Igatherv(np.ascontiguousarray(data, np.uint8), recv, root=root)], timeout,
             what)
    if not mine:
        return None
    parts, lo = [], 0
    for c in counts_l:
        parts.append(out[lo:lo + c].tobytes())
        lo += c
    return parts


def allreduce(comm, buf, op, timeout: float, what: str) -> None:
    """``buf`` reduced in place over ``comm`` with ``op``; fails after ``timeout`` seconds."""
    wait_all([comm.Iallreduce(MPI.IN_PLACE, buf, op=op)], timeout, what)


# seconds a wait on a large collective (the gradient's or the parameters' allreduce, the
# bfloat16 wire's Ialltoallv and Iallgatherv) polls without sleeping (Poller): MPI moves it on
# only inside MPI calls
SPIN_S = 0.05

# Where every rank of this node has cores of its own (dedicate), a wait for a reply that a
# peer sends at once (a shard's parameters or embedding rows) polls without sleeping for its
# first SPIN_S too: over TCP (libfabric's tcp provider) the reply moves only while the
# receiver is inside MPI, and downpour's fetch of 2.7 MB over a 10 Gb/s link, polled with
# the back-off's sleeps, took twice as long as a ping-pong. With more ranks than cores the
# spin takes the core the shard needs (downpour, 8 ranks on 2 cores, spinning: 3,916 and
# 4,399 examples/s against 5,037 and 4,540), so there the waits back off as before.
_reply_spin_s = 0.0


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity: a Slurm allocation's cgroup, a
    launcher's binding)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def dedicate(ranks: list[tuple[str, tuple[int, ...]]], threads: int = 1) -> bool:
    """Say where the job's ranks run: ``ranks``, every rank's host and
    :func:`usable_cores`; each rank runs ``threads`` threads. True (and waits for replies
    spin first, :func:`reply_spin_s`) when the ranks on this rank's host have a core each
    among the cores any of them may use (ranks bound one to a core count as theirs)."""
    global _reply_spin_s
    here = host()
    mine = [cores for name, cores in ranks if name == here]
    cores = set().union(*mine) if mine else set(usable_cores())
    own = max(1, len(mine)) * max(1, threads) <= len(cores)
    _reply_spin_s = SPIN_S if own else 0.0
    return own


def reply_spin_s() -> float:
    """Seconds a wait for a peer's prompt reply polls without sleeping (see
    :func:`dedicate`): SPIN_S where this node's ranks have cores of their own, else 0."""
    return _reply_spin_s


def _reduce_scatter_bf16(comm, send: np.ndarray, counts, recv: np.ndarray, out: np.ndarray,
                        timeout: float, what: str) -> None:
    """The sum over ``comm`` of every rank's bfloat16 block for this rank, in float32.

    ``send`` (uint16) holds this rank's contributions to every rank's block, in rank order,
    ``counts`` values each; ``recv`` (uint16, size x counts[me]) receives the others'
    contributions to this rank's block, and ``out`` (float32, counts[me]) their sum, added in
    rank order so every run gives the same bits."""
    size, me = comm.Get_size(), comm.Get_rank()
    mine = counts[me]
    req = comm.Ialltoallv([send, counts, displacements(counts), MPI.UINT16_T],
                          [recv, [mine] * size, [mine * r for r in range(size)], MPI.UINT16_T])
    wait_all([req], timeout, what, SPIN_S)
    out[:] = 0.0
    for r in range(size):
        bf16.accumulate(recv[r * mine:(r + 1) * mine], out)


class SumAllreduce:
    """``buf`` summed in place over ``comm``, its values travelling in ``wire``'s format.

    Built once per buffer length (its scratch buffers are kept), called every step. On the
    float32 wire: one ``Iallreduce``. On the bfloat16 wire (``--wire-dtype bf16``) it is a
    reduce-scatter then an allgather, the way a ring allreduce moves its data: each rank sends
    its bf16 values to the rank that owns their block (``Ialltoallv``), sums its own block in
    float32, rounds the sum to bf16 and sends it to every rank (``Iallgatherv``). Each rank
    sends 2 (R-1)/R x 2 bytes per value, half of the float32 ring's, and every rank ends with
    the same bits. The last ``exact`` values of ``buf`` (a loss riding along) are summed as
    float32 in a small ``Iallreduce`` beside it.
    """

    def __init__(self, comm, n: int, wire: Wire = FP32, exact: int = 0):
        self.comm = comm
        self.n = n - exact
        self.exact = exact
        self.wire = wire
        size = comm.Get_size()
        self.counts = block_counts(self.n, size)
        if wire.bf16:
            mine = self.counts[comm.Get_rank()]
            self._send = np.empty(self.n, np.uint16)
            self._recv = np.empty(mine * size, np.uint16)
            self._out = np.empty(self.n, np.uint16)

    def payload_bytes(self) -> int:
        """Bytes of this rank's values as the wire carries them (what a trace records)."""
        return self.n * self.wire.itemsize + 4 * self.exact

    def bytes_sent(self) -> float:
        """Bytes this rank sends per call (the ring's figure: 2 (R-1)/R per value)."""
        size = self.comm.Get_size()
        return 2 * (self.n * self.wire.itemsize + 4 * self.exact) * (size - 1) / size

    def __call__(self, buf: np.ndarray, op, timeout: float, what: str) -> None:
        if not self.wire.bf16 or self.comm.Get_size() == 1:
            wait_all([self.comm.Iallreduce(MPI.IN_PLACE, buf, op=op)], timeout, what, SPIN_S)
            return
        if op is not MPI.SUM:
            raise ValueError("the bfloat16 wire sums; other reductions travel as float32")
        n, comm = self.n, self.comm
        size, me = comm.Get_size(), comm.Get_rank()
        mine, lo = self.counts[me], displacements(self.counts)[me]
        more = []
        if self.exact:
            more.append(comm.Iallreduce(MPI.IN_PLACE, buf[n:], op=MPI.SUM))
        bf16.encode(buf[:n], self._send)
        req = comm.Ialltoallv([self._send, self.counts, displacements(self.counts),
                               MPI.UINT16_T],
                              [self._recv, [mine] * size, [mine * r for r in range(size)],
                               MPI.UINT16_T])
        wait_all([req, *more], timeout, what, SPIN_S)
        # this rank's block: the R contributions summed in float32, in rank order, and
        # rounded in one pass, straight into the allgather's buffer
        bf16.sum_blocks(self._recv, size, self._out[lo:lo + mine])
        wait_all([comm.Iallgatherv(MPI.IN_PLACE, [self._out, self.counts,
                                                  displacements(self.counts), MPI.UINT16_T])],
                 timeout, what, SPIN_S)
        bf16.decode(self._out, buf[:n])


def bcast(comm, buf, root: int, timeout: float, what: str) -> None:
    """``buf`` from ``root`` to every rank of ``comm``; fails after ``timeout`` seconds."""
    wait_all([comm.Ibcast(buf, root=root)], timeout, what)


def barrier(comm, timeout: float, what: str) -> None:
    """A barrier that fails after ``timeout`` seconds instead of hanging."""
    wait_all([comm.Ibarrier()], timeout, what)


def dup_comm(comm, copies: int, timeout: float, what: str) -> list:
    """``copies`` duplicates of ``comm`` (collective over it: every rank asks for the same
    number, in the same order), each waited on with ``timeout``."""
    out = []
    for _ in range(copies):
        new, req = comm.Idup()
        wait_all([req], timeout, what)
        out.append(new)
    return out


def gather_to_root(comm, local: np.ndarray, counts, timeout: float, what: str,
                   root: int = 0) -> np.ndarray | None:
    """Concatenate every rank's float32 block, in rank order, on ``root`` (None elsewhere).

    ``counts[i]`` is rank i's block length (every rank passes the same list). Collective
    over ``comm``.
    """
    counts = [int(c) for c in counts]
    displs = displacements(counts)
    mine = comm.Get_rank() == root
    out = np.empty(sum(counts), np.float32) if mine else None
    recv = [out, counts, displs, MPI.FLOAT] if mine else None
    wait_all([comm.Igatherv(np.ascontiguousarray(local, np.float32), recv, root=root)],
             timeout, what)
    return out


def host() -> str:
    return socket.gethostname()


class ReplicaExchange:
    """Model parallelism's traffic inside one replica, over its replica communicator.

    ``gather``: every partition's block of a layer's activations to every partition (an
    allgather: each value is sent once to each of the P-1 other ranks). ``scatter_sum``: the
    partitions' contributions to the previous layer's error terms summed, each partition
    receiving the rows it owns (a reduce-scatter). Counts the bytes this rank sends and the
    seconds it spends in these exchanges (waiting included), for the progress line.

    On the bfloat16 wire (``--wire-dtype bf16``) both carry bf16 values: the gather sends
    each partition's block rounded to bf16, and the reduce-scatter sends the contributions as
    bf16 and sums them in float32 where they arrive.
    """

    def __init__(self, comm, timeout: float, wire: Wire = FP32):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.parts = comm.Get_size()
        self.timeout = timeout
        self.wire = wire
        self.bytes_sent = 0
        self.wait_s = 0.0

    def _run(self, req, what: str) -> None:
        t = time.perf_counter()
        wait_all([req], self.timeout, f"the other partitions of this replica ({what})",
                 SPIN_S)
        self.wait_s += time.perf_counter() - t

    def gather(self, local_t: np.ndarray, widths) -> np.ndarray:
        batch = local_t.shape[1]
        counts = [w * batch for w in widths]
        displs = displacements(counts)
        out = np.empty((sum(widths), batch), dtype=np.float32)
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        sent = local_t.size * self.wire.itemsize * (self.parts - 1)
        if self.wire.bf16:
            words = np.empty(sum(counts), np.uint16)
            lo = displs[self.rank]
            bf16.encode(np.ascontiguousarray(local_t, np.float32).ravel(),
                        words[lo:lo + counts[self.rank]])
            self._run(self.comm.Iallgatherv(MPI.IN_PLACE, [words, counts, displs,
                                                           MPI.UINT16_T]),
                      "activation exchange")
            bf16.decode(words, out.reshape(-1))
        else:
            self._run(self.comm.Iallgatherv(local_t, [out, counts, displs, MPI.FLOAT]),
                      "activation exchange")
        self.bytes_sent += sent
        if tr is not None:
            tr.message("allgather activations (partitions)", sent, t0)
        return out

    def scatter_sum(self, partial_t: np.ndarray, widths) -> np.ndarray:
        batch = partial_t.shape[1]
        counts = [w * batch for w in widths]
        out = np.empty((widths[self.rank], batch), dtype=np.float32)
        tr = trace.ACTIVE
        t0 = tr.now() if tr is not None else 0
        sent = (partial_t.size - out.size) * self.wire.itemsize
        if self.wire.bf16:
            words = np.empty(partial_t.size, np.uint16)
            bf16.encode(np.ascontiguousarray(partial_t, np.float32).ravel(), words)
            recv = np.empty(out.size * self.parts, np.uint16)
            t = time.perf_counter()
            _reduce_scatter_bf16(self.comm, words, counts, recv, out.reshape(-1), self.timeout,
                                 "the other partitions of this replica (error-term exchange)")
            self.wait_s += time.perf_counter() - t
        else:
            self._run(self.comm.Ireduce_scatter(partial_t, out, counts, op=MPI.SUM),
                      "error-term exchange")
        self.bytes_sent += sent
        if tr is not None:
            tr.message("reduce-scatter error terms (partitions)", sent, t0)
        return out


def has_thread_multiple(provided: int | None = None) -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (given, or as this process has it)."""
    return (MPI.Query_thread() if provided is None else provided) >= MPI.THREAD_MULTIPLE
