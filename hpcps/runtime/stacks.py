"""Stalls explain themselves: when a wait times out, every rank writes its Python stack (all
threads) to ``RUN_DIR/stacks/rank-K.txt``, and the error says who waited for whom, what for,
and where each rank was.

Why not over MPI: the rank that stalled may be blocked in an MPI call or in a long
computation, so it cannot be asked with a message. Instead every rank runs a watchdog
(:meth:`StackDumper.start`), a daemon thread that looks for a request file in the run
directory every ``POLL_S`` seconds and, when it appears, writes ``sys._current_frames()`` of
its process (every thread) next to it. The run directory must therefore be on a filesystem
every node sees (the usual case on a cluster: it also holds the checkpoint). The rank whose
wait timed out (:meth:`StackDumper.explain`, called by ``train.guarded`` before it aborts
the job):

1. writes its own stack, the frames of the timed-out wait included (from the exception),
2. creates the request ``stacks/request-<token>`` (atomically and exclusively; the token is
   the job's, so a stale request left by an earlier job in the same run directory is
   ignored, and when several ranks time out together only the first reports),
3. waits at most ``collect_wait(timeout)`` seconds for the other ranks' files,
4. reads the first lines of each (what the rank was waiting for, if anything, and its top
   frames) and returns a summary for the error message: the ranks that were *not* waiting on
   another rank come first, as the likely cause.

A live job can be asked the same without ending it: ``python -m hpcps.stacks RUN_DIR``
(:func:`ask`) writes ``stacks/ask-<token>`` with a new id (rank 0 names the job's token and
size in ``stacks/job`` at start); every rank's watchdog answers each new id with its stack
file, and the command prints the same summary and exits; training goes on.

Limits: a rank whose process holds the GIL without releasing it (a C extension computing
with the GIL held) cannot run its watchdog, and a node that does not see the run directory
never sees the request; both show as "no stack written" in the summary. A rank killed before
the timed-out rank aborts writes nothing. Cost while nothing is wrong: three failed opens (the
request, the ask and the ending announcement, ``ENDING``) per rank every ``POLL_S`` seconds.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from hpcps.io.runlog import replace_text, run_ended

POLL_S = 0.5
REFRESH_S = 1.0
# a rank asked for its stack that timed out too writes its own dump as it unwinds (where its
# wait timed out); its watchdog leaves it this long, so that the unwinding is not what is
# written (the server of a stalled run was once recorded "at updatecache (linecache.py)")
UNWIND_GRACE_S = 1.0
# a rank the failure found gone (dead, or silent past the heartbeat timeout) gets this long
# past the other ranks' dumps to write its own (it is likely dead: it writes none)
LOST_GRACE_S = 2.0
REQUEST = "request"
# stacks/ending-<token>: a rank is aborting the job (its exit code and rank). Where the abort
# ends every rank (MPICH) nobody reads it in time; where it ends only the aborting rank (Open
# MPI under --enable-recovery treats an MPI_Abort as that rank's failure), every other
# rank's watchdog ends its own process ENDING_GRACE_S after it appears, instead of each
# waiting out --timeout on the ranks gone.
ENDING = "ending"
ENDING_GRACE_S = 3.0
ASK = "ask"      # stacks/ask-<token>: a live job asked for its stacks (python -m hpcps.stacks)
JOB = "job"      # stacks/job: the running job's token and size, written by rank 0
ASKED = "asked: "  # an answer's reason: this, then the ask's id
ENDED_EVERY_S = 0.5  # how often an ask looks whether the run has ended (its metrics' tail)
TOP_FRAMES = 3
# frames of these functions are the machinery of waiting, not where a rank is
_WAIT_FUNCS = {("comm.py", "wait_all"), ("serve.py", "serve"), ("comm.py", "barrier"),
               ("comm.py", "pause")}


def collect_wait(timeout: float) -> float:
    """Seconds the timed-out rank waits for the others' stacks: long enough for several
    watchdog polls on a loaded node and a shared filesystem's attribute cache, short next to
    the ``--timeout`` already spent."""
    return max(5.0, min(30.0, timeout / 2))


def stacks_dir(run_dir) -> Path:
    return Path(run_dir) / "stacks"


def _short(filename: str) -> str:
    """A source path from the package root on (``hpcps/mpi/comm.py``), else its base name."""
    parts = Path(filename).parts
    if "hpcps" in parts:
        i = len(parts) - 1 - parts[::-1].index("hpcps")
        return "/".join(parts[i:])
    return Path(filename).name


def _waiting_in(frames) -> str | None:
    """What a stack (outermost first: list of frame objects) is waiting for, read from the
    locals of the wait it is in (``wait_all``'s ``what``, ``serve``'s ``waiting_for()``)."""
    for f in reversed(frames):
        name, base = f.f_code.co_name, Path(f.f_code.co_filename).name
        if (base, name) == ("comm.py", "wait_all"):
            return str(f.f_locals.get("what"))
        if (base, name) == ("serve.py", "serve"):
            fn = f.f_locals.get("waiting_for")
            try:
                return "a message from " + str(fn()) if fn is not None else None
            except Exception:  # the loop's state may change under us: say less
                return "a message (server loop)"
    return None


def _where(summary) -> str:
    """``func (file:line) <- caller (...)``: the innermost frames that are not waiting
    machinery, from a list of traceback.FrameSummary (outermost first)."""
    keep = [fs for fs in summary if (Path(fs.filename).name, fs.name) not in _WAIT_FUNCS
            and "threading.py" not in fs.filename]
    if not keep:
        keep = list(summary)
    top = keep[-TOP_FRAMES:][::-1]
    return " <- ".join(f"{fs.name} ({_short(fs.filename)}:{fs.lineno})" for fs in top)


def _frames_of(frame) -> list:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out[::-1]


@dataclass
class Dump:
    """One rank's dump, as read back from its file's header."""

    rank: int
    role: str
    waiting: str | None
    where: str
    path: Path
    reason: str = ""


class StackDumper:
    """This rank's side of the mechanism: its file, its watchdog, and (when its own wait
    times out) the request and the collection.

    Parameters
    ----------
    run_dir : the run directory (shared by every rank).
    rank, size : this rank's world rank and the world's size.
    role : this rank's role (``replica``, ``server``, ``coordinator``), for the summary.
    token : the same string on every rank of this job (``train.py`` broadcasts it).
    host : this rank's host name.
    """

    def __init__(self, run_dir, rank: int, size: int, role: str, token: str, host: str):
        self.dir = stacks_dir(run_dir)
        self.rank, self.size, self.role = rank, size, role
        self.token, self.host = token, host
        self.written = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- writing ---------------------------------------------------------------------------
    def path(self, rank: int) -> Path:
        return self.dir / f"rank-{rank}.txt"

    def write(self, reason: str, exc: BaseException | None = None, final: bool = True) -> Path:
        """Write this rank's stack, every thread, to ``stacks/rank-K.txt`` (atomically).
        With ``exc``, the calling thread's stack is the exception's (where it was raised).
        ``final``: the dump of a time-out (the watchdog then writes no other); an answer to
        an ask is not."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        blocks, found = [], {}
        main = threading.main_thread().ident
        for tid in sorted(frames, key=lambda t: (t != main, t)):
            if self._thread is not None and tid == self._thread.ident:
                continue  # the watchdog itself
            if tid == me and exc is not None and exc.__traceback__ is not None:
                objs = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
                summary = traceback.extract_tb(exc.__traceback__)
            else:
                objs = _frames_of(frames[tid])
                summary = traceback.StackSummary.extract((f, f.f_lineno) for f in objs)
            waits = _waiting_in(objs)
            if waits is None and tid == me and exc is not None:
                waits = str(exc)  # the rank that timed out was waiting, by definition
            found[tid] = (waits, _where(summary))
            blocks.append(f"Thread {names.get(tid, '?')} ({tid}):\n"
                          + "".join(traceback.format_list(summary)))
        # the main thread says where the rank is, unless another thread (a Hogwild thread of
        # a model-parallel replica) is the one waiting on a peer
        waiting, where = found.get(main, (None, ""))
        if waiting is None:
            waiting, where = next((v for v in found.values() if v[0] is not None),
                                  (waiting, where))
        head = [f"# hpcps stack dump: rank {self.rank} of {self.size} ({self.role}) on "
                f"{self.host}, pid {os.getpid()}",
                f"# token: {self.token}",
                f"# reason: {reason}",
                f"# waiting: {waiting or '-'}",
                f"# where: {where}",
                ""]
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(self.rank)
        replace_text(path, "\n".join(head) + "\n".join(blocks) + "\n")
        if final:
            self.written.set()
        return path

    # -- the watchdog ------------------------------------------------------------------------
    def start(self) -> "StackDumper":
        """Start the watchdog thread (daemon: it never keeps the process alive); rank 0
        names the job in ``stacks/job`` for :func:`ask`."""
        if self.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                replace_text(self.dir / JOB, f"{self.token}\n{self.size}\n")
            except OSError as exc:
                print(f"hpcps: rank 0: cannot write {self.dir / JOB} ({exc}): "
                      "python -m hpcps.stacks cannot ask this job", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._watch, name="hpcps-stack-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def request_path(self) -> Path:
        return self.dir / f"{REQUEST}-{self.token}"

    def _request(self) -> str | None:
        """The reason in this job's request, or None while there is none."""
        try:
            return self.request_path().read_text().strip()
        except OSError:
            return None

    def _asked(self) -> str | None:
        """The id in this job's ask file, or None while there is none."""
        try:
            return (self.dir / f"{ASK}-{self.token}").read_text().strip() or None
        except OSError:
            return None

    def ending_path(self) -> Path:
        return self.dir / f"{ENDING}-{self.token}"

    def announce_end(self, code: int) -> None:
        """This rank aborts the job with exit code ``code`` now: the other ranks' watchdogs
        end their processes with it if the abort does not end them first (see ENDING)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _create_once(self.ending_path(), f"{code}\n{self.rank}\n")
        except OSError:
            pass  # the abort alone, then: the others end by their own timeouts

    def _ending(self) -> tuple[int, int] | None:
        """(exit code, rank) of the rank ending this job, or None while none is."""
        try:
            code, rank = self.ending_path().read_text().split()[:2]
            return int(code), int(rank)
        except (OSError, ValueError):
            return None

    def _watch(self) -> None:
        answered, requested = None, False
        while not self._stop.wait(POLL_S):
            ending = self._ending()
            if ending is not None and ending[1] != self.rank:
                self._end(*ending)
                return
            reason = None if requested else self._request()
            if reason is not None:
                requested = True
                if not self.written.wait(UNWIND_GRACE_S):
                    self._write_or_say(reason)
                continue
            asked = self._asked()
            if asked is not None and asked != answered:
                answered = asked
                self._write_or_say(f"{ASKED}{asked}", final=False)

    def _end(self, code: int, rank: int) -> None:
        """Rank ``rank`` is aborting the job: end this process with its exit code, unless the
        abort (or this rank's own end) comes first."""
        if self._stop.wait(ENDING_GRACE_S):
            return  # this rank is ending on its own
        print(f"hpcps: rank {self.rank} of {self.size} on {self.host} ({self.role}) ends: "
              f"rank {rank} aborted the job (exit code {code}) and MPI left this rank "
              "running", file=sys.stderr, flush=True)
        from hpcps.runtime.faults import leave
        leave(code)

    def _write_or_say(self, reason: str, final: bool = True) -> None:
        try:
            self.write(reason, final=final)
        except OSError as exc:
            print(f"hpcps: rank {self.rank}: could not write its stack to {self.dir}: {exc}",
                  file=sys.stderr, flush=True)

    # -- the timed-out rank --------------------------------------------------------------------
    def explain(self, exc: BaseException, timeout: float) -> tuple[str, float]:
        """Write this rank's stack, ask every other rank for theirs, wait for them (bounded)
        and return the summary lines for the error message, and the seconds to wait before
        printing it: 0 for the rank whose request came first (it reports for the job), more
        for a rank that timed out at the same time (the reporter's abort ends it first, so the
        job prints one explanation)."""
        reason = f"rank {self.rank} timed out: {exc}"
        try:
            return self._explain(exc, reason, timeout)
        except Exception:  # never let the explanation stop the abort that ends the job
            return "\n  (stack dumps failed: " + traceback.format_exc(limit=3) + ")", 0.0

    def _explain(self, exc: BaseException, reason: str, timeout: float) -> tuple[str, float]:
        wait_s = collect_wait(timeout)
        try:
            self.write(reason, exc)
            first = _create_once(self.request_path(), reason + "\n")
        except OSError as exc2:
            return f"\n  (no stack dumps: cannot write to {self.dir}: {exc2})", 0.0
        # ranks the failure found gone (a dead shard): a dead rank writes nothing
        lost = set(getattr(exc, "lost", ())) - {self.rank}
        dumps = self.collect(wait_s, lost=lost)
        return (summarize(dumps, self.size, self.dir, wait_s, lost=lost),
                0.0 if first else wait_s + 5)

    def collect(self, wait_s: float, lost=frozenset()) -> dict[int, Dump]:
        """Every rank's dump of this job that appears within ``wait_s`` seconds. The ranks in
        ``lost`` (the failure found them gone: dead, or silent past the heartbeat timeout)
        are waited for only ``LOST_GRACE_S`` past the others' dumps: a dead rank writes
        none, and the wait would only delay the end of the job.

        Once all are in, they are read once more ``REFRESH_S`` later: a rank that timed out
        too may have been caught by its watchdog while unwinding, and then rewrites its file
        with the frames of its own timed-out wait."""
        deadline = time.monotonic() + wait_s
        dumps: dict[int, Dump] = {}
        others = [r for r in range(self.size) if r not in lost]
        while len(dumps) < self.size and time.monotonic() < deadline:
            for r in range(self.size):
                if r not in dumps:
                    d = read_dump(self.path(r), self.token)
                    if d is not None:
                        dumps[r] = d
            if all(r in dumps for r in others):
                deadline = min(deadline, time.monotonic() + LOST_GRACE_S)
            time.sleep(0.1)
        time.sleep(REFRESH_S)
        for r in dumps:
            dumps[r] = read_dump(self.path(r), self.token) or dumps[r]
        return dumps


def _create_once(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists (atomic and exclusive: a hard link of
    a finished temporary file). True if this call created it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)  # (also after a write that failed: a full disk)


def read_dump(path: Path, token: str | None = None) -> Dump | None:
    """The header of a stack file (None if absent, unreadable or from another job)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    head = {}
    for line in lines:
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        head[key] = value
    if token is not None and head.get("token") != token:
        return None
    first = head.get("hpcps stack dump", "")
    try:
        rank = int(first.split()[1])
        role = first.split("(", 1)[1].split(")", 1)[0]
    except (IndexError, ValueError):
        return None
    waiting = head.get("waiting")
    return Dump(rank, role, None if waiting in (None, "-") else waiting,
                head.get("where", "?"), path, head.get("reason", ""))


def summarize(dumps: dict[int, Dump], size: int, where_dir: Path, wait_s: float,
              stalled: bool = True, lost=()) -> str:
    """The lines the error message gets: first the ranks not waiting on another rank (the
    likely cause of the stall, when ``stalled``), then the waiting ones, then those that
    wrote nothing, then those of ``lost`` (the failure found them gone) that wrote nothing."""
    idle = [d for r, d in sorted(dumps.items()) if d.waiting is None]
    waiting = [d for r, d in sorted(dumps.items()) if d.waiting is not None]
    missing = [r for r in range(size) if r not in dumps and r not in lost]
    gone = sorted(r for r in lost if r not in dumps)
    lines = [f"stacks of {len(dumps)} of {size} ranks in {where_dir}/rank-K.txt"]
    if idle:
        lines.append("not waiting on another rank"
                     + (" (the likely cause): " if stalled else ": ")
                     + ", ".join(f"rank {d.rank}" for d in idle))
    for d in idle:
        lines.append(f"  rank {d.rank} ({d.role}) was at {d.where}")
    for d in waiting:
        lines.append(f"  rank {d.rank} ({d.role}) was waiting for {d.waiting}, at {d.where}")
    if missing:
        lines.append(f"  no stack written within {wait_s:.0f} s by rank(s) "
                     f"{', '.join(map(str, missing))}: killed, holding the GIL in a C call, or "
                     "on a node that does not see the run directory")
    if gone:
        lines.append(f"  no stack written by rank(s) {', '.join(map(str, gone))}, which the "
                     "run had already lost (dead, or silent past --heartbeat-timeout)")
    return "\n" + "\n".join(lines)


# -- asking a live job -------------------------------------------------------------------------
def ask(run_dir, wait_s: float = 10.0) -> tuple[str, int, int, str | None]:
    """Ask the job running in ``run_dir`` for every rank's stack without stopping it: write a
    new id to ``stacks/ask-<token>``, wait at most ``wait_s`` seconds for every rank's
    answer, and return (the summary, ranks that answered, the job's size, how the run ended
    when its metrics say it has: then the ranks still missing are not waited for). Raises
    FileNotFoundError when the directory names no job (``stacks/job``)."""
    d = stacks_dir(run_dir)
    try:
        token, size = (d / JOB).read_text().split()[:2]
    except (OSError, ValueError):
        raise FileNotFoundError(f"{d / JOB} does not name a job: is {run_dir} the run "
                                "directory of an hpcps run (started by this version)?") from None
    size = int(size)
    asked = f"{os.getpid()}-{time.time():.6f}"
    replace_text(d / f"{ASK}-{token}", asked + "\n")
    deadline = time.monotonic() + wait_s
    dumps: dict[int, Dump] = {}
    ended, looked = run_ended(run_dir), time.monotonic()
    while len(dumps) < size and time.monotonic() < deadline and ended is None:
        for r in range(size):
            if r not in dumps:
                got = read_dump(d / f"rank-{r}.txt", token)
                if got is not None and got.reason == ASKED + asked:
                    dumps[r] = got
        time.sleep(0.1)
        if time.monotonic() - looked > ENDED_EVERY_S:
            ended, looked = run_ended(run_dir), time.monotonic()
    return summarize(dumps, size, d, wait_s, stalled=False), len(dumps), size, ended


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m hpcps.stacks",
        description="Print where every rank of a running hpcps job is, and what it waits "
                    "for, without stopping it (each rank's whole stack goes to "
                    "RUN_DIR/stacks/rank-K.txt).")
    p.add_argument("run_dir", help="the job's run directory (--run-dir)")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds to wait for the ranks' answers (default 10)")
    args = p.parse_args(argv)
    try:
        text, answered, size, ended = ask(args.run_dir, args.wait)
    except (FileNotFoundError, OSError) as exc:
        print(f"hpcps.stacks: error: {exc}", file=sys.stderr)
        return 2
    if ended is not None and answered < size:
        print(f"hpcps.stacks: the run in {args.run_dir} has ended ({ended}): no job to ask",
              file=sys.stderr)
        return 1
    print(text.lstrip("\n"))
    if answered < size:
        print(f"hpcps.stacks: {size - answered} of {size} ranks did not answer within "
              f"{args.wait:g} s (has the job ended?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
