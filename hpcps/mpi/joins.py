"""Ranks that join a running job (``--joins J``): a second launch connects through MPI ports.

The job's side. Every *listener* (world rank 0, the chief, and every rank that is or may become
a shard) opens an MPI port at start and writes its name to ``RUN_DIR/join/port-<rank>``. Its
communicator is a :class:`RoutedComm`: the job's world, plus one intercommunicator per launch
that joined it, so the roles address a newcomer by a rank of its own, past the world's
(``n_world + j`` for the j-th joined rank), and the transport routes each message.

The newcomers' side (:func:`connect`, run by ``python -m hpcps.join RUN_DIR``). The launch
connects to the chief first: the chief hands it J slots' worth of ranks, the job's
configuration and the listeners that are alive; then it connects to every other listener, and
tells the chief it is ready (``JOIN_READY``), after which the chief treats it as a spare
(:mod:`hpcps.ps.spares`). Its own communicator is a :class:`RoutedComm` too: every listener is
one intercommunicator away, under its world rank.

When to accept. MPICH's ``MPI_Comm_accept`` holds the lock every MPI call of the process takes,
so a thread waiting in it would stop the rank (measured: a shard's serving loop froze). A
listener therefore accepts only when a connection is about to come: the launch writes
``RUN_DIR/join/<id>.to-<rank>``, naming its lead process; the listener, which looks at that
folder at most every ``LOOK_EVERY_S`` when it probes for messages, claims the request (renames
it) and, unless that process has died meanwhile, accepts; the launch connects once the
request is claimed. Between the claim and the connection the launch defers SIGTERM and SIGINT
(:mod:`hpcps.join`), so that only a SIGKILL in those milliseconds can leave a listener
waiting. A listener that claims nothing within
``CLAIM_S`` (the chief: the launch's timeout) is taken for dead and the request withdrawn, so
no listener accepts a connection that will not come, and no launch connects to a dead rank's
port (which crashes it under MPICH's UCX transport). The launch gives up sooner when it sees
why (:func:`_stopped`, :func:`not_joinable`): the listener's process on this host has ended,
it removed its port file, or the run is ending (the chief's port file gone, or the run's
summary written). The serving loop stops for the connection alone (milliseconds on one
node).

Sends to a dead peer. MPICH creates its UCX endpoints without a peer-failure mode, so a send
to a rank of another launch that has died ends the sender (SIGSEGV, measured: every time, even
a header of 32 bytes). Each side therefore learns the other's process on the same host (its
pid and start time: in the HELLO for the newcomers, in the port file for the listeners) and
drops a send to one that is gone, as it drops one to an unrouted rank. Receives and probes are
left alone (they touch no endpoint of the peer, and a message it sent before dying may still
be taken). A peer on another host has no such check: its death is seen by the heartbeats, and
a send in the moment between its death and the heartbeat timeout can still end the sender.

Open MPI cannot do this between two ``mpirun`` launches without a shared PMIx server (a PRRTE
DVM); there :func:`connect` gives up after its timeout with one line saying so.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from mpi4py import MPI

from hpcps import procfs
from hpcps.errors import ConfigError, HpcpsError
from hpcps.io.runlog import ended_in, replace_text
from hpcps.mpi.comm import Poller
from hpcps.mpi.protocol import Tag

LOOK_EVERY_S = 0.25  # a listener looks for connections this often (one listdir)
CLAIM_S = 10.0  # a shard that takes no request this long is taken for dead by a launch
PORT_FILE = "port-{rank}"
HOST = socket.gethostname()


class JoinError(HpcpsError):
    """A launch could not join the job (no job listening, no slot free, the run ending)."""

    exit_code = 2


def join_dir(run_dir) -> Path:
    return Path(run_dir) / "join"


def identity() -> dict:
    """This process, as a peer on the same host checks that it is alive."""
    me = procfs.stat(os.getpid())
    return {"host": HOST, "pid": os.getpid(), "start": me.start if me else None}


def is_gone(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` that started at ``start`` has died (exited, killed, a zombie
    not yet reaped, or its pid reused by another process)."""
    now = procfs.stat(pid)
    return now is None or now.state in ("Z", "X", "x") or (start is not None
                                                          and now.start != start)


class RoutedComm:
    """A communicator that reaches, besides the job's world, the ranks that joined it.

    Point-to-point calls (the ones :class:`hpcps.mpi.comm.Transport` makes) go to the world for
    a world rank and to the intercommunicator of a joined rank otherwise; a probe of any
    source looks at every one of them and reports the sender under its rank. Every other
    attribute (collectives, splits) is the world's. A message to a rank that is not (or no
    longer) reachable is dropped, as one to a dead rank is.

    Parameters
    ----------
    base : the job's world (None on a newcomer: it reaches only the listeners).
    me : this rank's rank (a newcomer's: past the world's).
    n_world : ranks of the job's world.
    slots : ranks that may join (J), ranks ``n_world .. n_world + J - 1``.
    """

    def __init__(self, base, me: int, n_world: int, slots: int):
        self.base = base
        self.me = me
        self.n_world = n_world
        self.slots = slots
        self._routes: dict[int, tuple] = {}  # rank -> (intercommunicator, its remote rank)
        self._local: dict[int, tuple] = {}  # rank -> (pid, start) of a routed peer on this host
        self._gone: set[int] = set()  # routed peers on this host whose process has ended
        self._inters: list[tuple] = []  # (intercommunicator, rank of its remote rank 0)
        self._turn = 0
        # listening (job side)
        self.port: str | None = None
        self.dir: Path | None = None
        self._next_look = 0.0
        self._seen: set[str] = set()
        self.allot = None  # on the chief: allot(n, want) -> (first rank, welcome) or refusal
        self.accept_timeout = 60.0

    # -- the communicator's face ----------------------------------------------------------
    def __getattr__(self, name):
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(f"a newcomer's communicator has no {name}")
        return getattr(base, name)

    def Get_rank(self) -> int:
        return self.me

    def Get_size(self) -> int:
        return self.n_world

    @property
    def joined(self) -> list[int]:
        """Ranks past the world's this rank reaches (on the chief: every rank that joined)."""
        return sorted(r for r in self._routes if r >= self.n_world)

    def _route(self, rank: int):
        if self.base is not None and 0 <= rank < self.n_world:
            return self.base, rank
        if rank == self.me:
            return MPI.COMM_SELF, 0
        return self._routes.get(rank, (None, None))

    def _send_route(self, rank: int):
        """The route of a send: none to a peer on this host whose process is gone (a send to
        it through UCX would end this process). Its receive route stays: a message it sent
        before dying may still be probed and taken."""
        if rank in self._gone:
            return None, None
        local = self._local.get(rank)
        if local is not None and is_gone(*local):
            self._gone.add(rank)  # for good: no more looks in /proc
            self._local.pop(rank, None)  # another thread (the heartbeats) may have found it
            return None, None
        return self._route(rank)

    def watch(self, rank: int, ident: dict | None) -> None:
        """Check that routed ``rank`` (whose :func:`identity` is ``ident``) is alive before
        each send to it, if it runs on this host."""
        if ident and ident.get("host") == HOST and ident.get("pid"):
            self._local[rank] = (int(ident["pid"]), ident.get("start"))
            self._gone.discard(rank)

    def Iprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None) -> bool:
        self.look()
        if source != MPI.ANY_SOURCE:
            comm, peer = self._route(source)
            if comm is None:
                return False
            found = comm.Iprobe(peer, tag, status)
            if found and status is not None and comm is not self.base:
                status.Set_source(source)
            return found
        st = status if status is not None else MPI.Status()
        comms = ([(self.base, None)] if self.base is not None else []) + self._inters
        self._turn = (self._turn + 1) % len(comms) if comms else 0
        for comm, first in comms[self._turn:] + comms[:self._turn]:
            if comm.Iprobe(MPI.ANY_SOURCE, tag, st):
                if first is not None:
                    st.Set_source(first + st.Get_source())
                return True
        return False

    def _never(self):
        return MPI.COMM_SELF.Irecv(bytearray(1), source=0, tag=Tag.NEVER)

    def Recv(self, buf, source, tag, status=None) -> None:
        comm, peer = self._route(source)
        if comm is None:
            raise MPI.Exception(MPI.ERR_RANK)
        comm.Recv(buf, source=peer, tag=tag, status=status)

    def Irecv(self, buf, source, tag):
        comm, peer = self._route(source)
        return self._never() if comm is None else comm.Irecv(buf, source=peer, tag=tag)

    def Send(self, buf, dest, tag) -> None:
        comm, peer = self._send_route(dest)
        if comm is not None:
            comm.Send(buf, dest=peer, tag=tag)

    def Isend(self, buf, dest, tag):
        comm, peer = self._send_route(dest)
        return MPI.REQUEST_NULL if comm is None else comm.Isend(buf, dest=peer, tag=tag)

    def send(self, obj, dest, tag) -> None:
        comm, peer = self._send_route(dest)
        if comm is not None:
            comm.send(obj, dest=peer, tag=tag)

    def isend(self, obj, dest, tag):
        comm, peer = self._send_route(dest)
        return MPI.REQUEST_NULL if comm is None else comm.isend(obj, dest=peer, tag=tag)

    def recv(self, source, tag):
        comm, peer = self._route(source)
        if comm is None:
            raise MPI.Exception(MPI.ERR_RANK)
        return comm.recv(source=peer, tag=tag)

    def irecv(self, source, tag):
        comm, peer = self._route(source)
        if comm is None:
            return MPI.COMM_SELF.irecv(source=0, tag=Tag.NEVER)
        return comm.irecv(source=peer, tag=tag)

    def Ack_failed(self):
        if self.base is not None:
            return self.base.Ack_failed()

    def add(self, inter, first: int) -> None:
        """Reach remote rank i of ``inter`` as rank ``first + i``."""
        for i in range(inter.Get_remote_size()):
            self._routes[first + i] = (inter, i)
        self._inters = self._inters + [(inter, first)]

    # -- listening (job side) ---------------------------------------------------------------
    def listen(self, run_dir, timeout: float) -> None:
        """Open this rank's port and publish it in ``RUN_DIR/join``."""
        self.dir = join_dir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = MPI.Open_port()
        self.accept_timeout = timeout
        replace_text(self.dir / PORT_FILE.format(rank=self.me),
                      json.dumps({"port": self.port, "id": identity()}))

    def look(self) -> None:
        """Accept the launches about to connect to this rank (cheap: one look at the folder
        every ``LOOK_EVERY_S``; only from the main thread, which owns the serving loop)."""
        if self.port is None or threading.current_thread() is not threading.main_thread():
            return
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + LOOK_EVERY_S
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        suffix = f".to-{self.me}"
        for name in sorted(names):
            if not name.endswith(suffix):
                continue
            claimed = self.dir / (name[:-len(suffix)] + f".claimed-{self.me}")
            try:  # claim the request: the launch connects only once it is claimed
                os.rename(self.dir / name, claimed)
            except OSError:
                continue  # the launch gave up waiting (or another look took it)
            if _requester_gone(claimed):  # it died after asking: nobody would connect
                claimed.unlink(missing_ok=True)
                continue
            self._accept()

    def _accept(self) -> None:
        inter = MPI.COMM_SELF.Accept(self.port)
        hello = _recv_by(inter, Tag.JOIN_HELLO, self.accept_timeout)
        if hello is None:  # the launch died while connecting
            inter.Free()
            return
        if self.allot is not None:  # the chief: ranks for the launch, and what it needs
            first, welcome = self.allot(inter.Get_remote_size(), hello.get("want"))
            inter.send(welcome, dest=0, tag=Tag.JOIN_WELCOME)
            if first is None:
                inter.Free()
                return
        else:
            first = int(hello["first"])
        self.add(inter, first)
        for i, ident in enumerate(hello.get("ids", [])):
            self.watch(first + i, ident)

    def stop_listening(self) -> None:
        if self.port is None:
            return
        try:  # a launch that looks now finds no job
            (self.dir / PORT_FILE.format(rank=self.me)).unlink()
        except OSError:
            pass
        try:
            MPI.Close_port(self.port)
        except MPI.Exception:
            pass
        self.port = None

    def close(self) -> None:
        """Stop listening and let the intercommunicators go (local: no joined rank waited
        for, dead or not)."""
        self.stop_listening()
        for inter, _ in self._inters:
            try:
                inter.Free()
            except MPI.Exception:
                pass
        self._inters, self._routes, self._local, self._gone = [], {}, {}, set()


def _recv_by(inter, tag: int, timeout: float):
    """The object remote rank 0 of ``inter`` sends with ``tag``, or None after ``timeout``."""
    req = inter.irecv(source=0, tag=tag)
    deadline = time.monotonic() + timeout
    poll = Poller()
    while True:
        done, obj = req.test()
        if done:
            return obj
        if time.monotonic() > deadline:
            req.Cancel()
            return None
        poll.pause()


OPEN_MPI_WHY = ("Open MPI cannot connect two separate mpirun launches without a PMIx server "
                "they share (a PRRTE DVM, which hpcps does not start): run the job and the "
                "joins under MPICH (the mpich wheel, or a system MPICH or Intel MPI)")


def check_mpi() -> None:
    """Refuse joins on an MPI that cannot connect two launches (Open MPI)."""
    if MPI.get_vendor()[0] == "Open MPI":
        raise ConfigError(f"--joins: {OPEN_MPI_WHY}")


def routed(world, run_dir, joins: int, listener: bool, timeout: float):
    """The job's world as a :class:`RoutedComm` (``joins`` > 0), listening on a listener."""
    if joins <= 0:
        return world
    check_mpi()
    comm = RoutedComm(world, world.Get_rank(), world.Get_size(), joins)
    if listener:
        comm.listen(run_dir, timeout)
    return comm


def close(world) -> None:
    if isinstance(world, RoutedComm):
        world.close()


def stop_listening(world) -> None:
    """No launch may join any more (the port closes; the ranks that joined stay reachable)."""
    if isinstance(world, RoutedComm):
        world.stop_listening()


def joined(world) -> list[int]:
    """Ranks that joined and that ``world`` reaches (none for a plain communicator)."""
    return world.joined if isinstance(world, RoutedComm) else []


class Slots:
    """On the chief: which ranks past the world's are given to the launches that join."""

    def __init__(self, n_world: int, joins: int):
        self.n_world, self.joins = n_world, joins
        self.given = 0
        self.open = True

    def take(self, n: int) -> tuple[int | None, str]:
        """The first of ``n`` ranks for a launch, or (None, why not)."""
        if not self.open:
            return None, "the run is ending"
        if self.given + n > self.joins:
            return None, (f"the job was started with --joins {self.joins} and "
                          f"{self.given} rank(s) joined already: {self.joins - self.given} "
                          f"slot(s) left, the launch has {n} rank(s)")
        first = self.n_world + self.given
        self.given += n
        return first, ""


def launch_rank() -> int:
    """This process's rank in its own launch (a newcomer's, before it joins)."""
    return MPI.COMM_WORLD.Get_rank()


def launch_size() -> int:
    """The ranks of this process's own launch (a newcomer's: K of ``mpiexec -n K``)."""
    return MPI.COMM_WORLD.Get_size()


def connect(run_dir, want: str, timeout: float, comm=None) -> tuple[RoutedComm, dict]:
    """On a newcomer launch: join the job running in ``run_dir``; every rank of ``comm`` (the
    launch's world) returns its communicator to the job and the chief's welcome (the job's
    configuration and this rank's place). Collective over ``comm``."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    if MPI.get_vendor()[0] == "Open MPI":
        raise JoinError(OPEN_MPI_WHY)
    d = join_dir(run_dir)
    lead = comm.Get_rank() == 0
    err, port0 = None, None
    if lead:
        err = not_joinable(run_dir)
        port0 = _wait_port(d, 0, timeout, lambda: not_joinable(run_dir)) if err is None else None
        if err is None and port0 is None:
            err = not_joinable(run_dir) or (
                f"no running job listens in {d} (started with --joins J, in this run "
                f"directory? {timeout:.0f} s waited for {d / PORT_FILE.format(rank=0)})")
        elif err is None and isinstance(port0, str):
            err, port0 = port0, None
    err = comm.bcast(err)
    if err is not None:
        raise JoinError(err)
    rid = comm.bcast(uuid.uuid4().hex[:12] if lead else None)
    ids = comm.gather(identity())

    def ending() -> str | None:  # the run ended, or the chief closed its port
        return not_joinable(run_dir) or _stopped(d / PORT_FILE.format(rank=0), port0["id"])

    def to(rank: int, port: dict | None, wait_s: float):
        """Connect to listener ``rank`` once it claimed the request (None if it did not
        within ``wait_s``: dead, or never looking; connecting to a dead rank's port crashes
        this process under MPICH)."""
        def gone() -> str | None:  # it stopped listening, or the run is ending
            return _stopped(d / PORT_FILE.format(rank=rank), port["id"]) or ending()
        claimed = _claimed(d / f"{rid}.to-{rank}", wait_s, gone) if lead else None
        if not comm.bcast(claimed):
            return None
        return comm.Connect(port["port"] if lead else "", root=0)

    inter0 = to(0, port0, timeout)
    if inter0 is None:
        why = None
        if lead:
            why = not_joinable(run_dir)  # the run ended meanwhile
            stopped = _stopped(d / PORT_FILE.format(rank=0), port0["id"])
            if why is None and stopped:
                why = (f"the job in {run_dir} stopped taking joins while this launch "
                       f"connected: its chief {stopped}")
            elif why is None:
                why = (f"no job answered in {timeout:.0f} s from {d} (the port file is there, "
                       "but nobody took the request: is the job stuck?)")
        raise JoinError(comm.bcast(why))
    welcome = None
    if lead:
        inter0.send({"want": want, "ids": ids}, dest=0, tag=Tag.JOIN_HELLO)
        welcome = _recv_by(inter0, Tag.JOIN_WELCOME, timeout)
        if welcome is None:
            welcome = {"refused": f"the job's chief did not answer in {timeout:.0f} s"}
    welcome = comm.bcast(welcome)
    if welcome.get("refused"):
        inter0.Free()
        raise JoinError(f"the job refused the join: {welcome['refused']}")
    first = int(welcome["first"])
    me = first + comm.Get_rank()
    out = RoutedComm(None, me, int(welcome["n_world"]), int(welcome["slots"]))
    out.add(inter0, 0)
    out.watch(0, comm.bcast(port0["id"] if lead else None))
    unreached, closing = [], []  # closing: not connected because the run is ending
    for rank in welcome["listeners"]:
        port = _wait_port(d, rank, timeout, ending) if lead else None
        closed = isinstance(port, str)  # the run is ending: this port will not come
        port = None if closed else port
        inter = to(rank, port, min(timeout, CLAIM_S)) if comm.bcast(port is not None) else None
        if inter is None:  # dead (its death not yet known to the chief), stuck, or ending
            if port is not None and lead:  # it closed its port while asked, or the run
                closed = not (d / PORT_FILE.format(rank=rank)).exists() or bool(ending())
            (closing if comm.bcast(closed) else unreached).append(rank)
            continue
        if lead:
            inter.send({"first": first, "ids": ids}, dest=0, tag=Tag.JOIN_HELLO)
        out.add(inter, rank)
        out.watch(rank, comm.bcast(port["id"] if lead else None))
    welcome["unreached"], welcome["closing"] = unreached, closing
    if lead:  # connected to every listener: the chief may hand these ranks out
        out.send({"first": first, "n": comm.Get_size(), "want": want,
                  "unreached": unreached}, 0, Tag.JOIN_READY)
        for name in os.listdir(d):
            if name.startswith(rid):
                try:
                    (d / name).unlink()
                except OSError:
                    pass
    return out, welcome


def not_joinable(run_dir) -> str | None:
    """Why no launch can join the job in ``run_dir``, when that shows at once: no such
    directory, its newest run started without --joins, or that run has ended (its summary,
    or the stop of a preempted run, is written). None: wait for its port."""
    run = Path(run_dir)
    if not run.is_dir():
        return f"{run} is not a directory: give the running job's run directory (its --run-dir)"
    try:
        text = (run / "metrics.jsonl").read_bytes()
    except OSError:
        return None  # the job is starting: its metrics are not there yet
    at = text.rfind(b'\n{"kind": "start"') + 1  # 0: the first line, or no start at all
    if not text.startswith(b'{"kind": "start"', at):
        return None
    newest = text[at:]
    try:
        joins = json.loads(newest[:newest.find(b"\n")])["config"].get("joins")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not joins:
        return (f"the job in {run} was started without --joins: ranks join only a job started "
                "with --joins J (J ranks at most)")
    ended = ended_in(newest)  # the file is read already
    if ended is not None:
        return (f"the run in {run} has ended ({ended}): there is no job to join; start one "
                "with --joins J (or --resume it)")
    return None


def _stopped(port_file: Path, ident: dict) -> str | None:
    """Why the listener of ``port_file`` takes no connection any more, if it shows: it
    stopped listening (its port file is gone), or its process on this host has ended."""
    if not port_file.exists():
        return "it closed its port (the run is ending)"
    if ident.get("host") == HOST and is_gone(int(ident["pid"]), ident.get("start")):
        return f"its process (pid {ident['pid']}) has ended"
    return None


def _requester_gone(request: Path) -> bool:
    """Whether the launch that wrote ``request`` (its lead's :func:`identity`) has died on
    this host: an accept for it would wait for a connection that never comes, holding the
    listener for good (MPI has no timeout on it)."""
    try:
        ident = json.loads(request.read_text() or "{}")
    except (OSError, ValueError):
        return False
    return bool(ident.get("host") == HOST and ident.get("pid")
                and is_gone(int(ident["pid"]), ident.get("start")))


def _claimed(request: Path, wait_s: float, gone=None) -> bool:
    """Write ``request`` (naming this process, the launch's lead) and wait until its
    listener claims it (renames it away); False if it did not within ``wait_s``, or before
    ``gone()`` (looked at 4 times a second) said why it never will, and the request was
    withdrawn first."""
    replace_text(request, json.dumps(identity()))
    deadline = time.monotonic() + wait_s
    looked = time.monotonic()
    while time.monotonic() < deadline:
        if not request.exists():
            return True
        if gone is not None and time.monotonic() - looked > 0.25:
            looked = time.monotonic()
            if gone():
                break
        time.sleep(0.02)
    try:
        request.unlink()  # withdrawn: a listener that looks later finds nothing to accept
    except FileNotFoundError:
        return True  # claimed at the last moment: it is accepting now
    return False


def _wait_port(d: Path, rank: int, timeout: float, why_not=None) -> dict | str | None:
    """Listener ``rank``'s port file: its port's name and its process (``identity``); None
    past ``timeout``, or what ``why_not()`` (looked at twice a second) says if it says why
    the port will never come."""
    path = d / PORT_FILE.format(rank=rank)
    deadline = time.monotonic() + timeout
    looked = time.monotonic()
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return None
        if why_not is not None and time.monotonic() - looked > 0.5:
            looked = time.monotonic()
            why = why_not()
            if why:
                return why
        time.sleep(0.05)
