"""The exceptions hpcps raises for bad input, each with the exit code the job ends with.

Every module raises one of these (never ``assert``) for input it refuses; ``train.py`` turns
them into one message and one exit code on every rank. The codes, in one place (the table in
``docs/errors.md`` says what each means to a user):

====  ===============================================================================
 1    a bug in hpcps (a Python traceback is printed), or an error outside hpcps's control
 2    :class:`ConfigError`: options, config files, layouts of ranks, the run directory
 3    :class:`DataError`: datasets (missing, not HDF5, wrong layout, non-finite features)
 4    :class:`CheckpointError`: checkpoints (missing, corrupt, incompatible, non-finite)
 5    ``hpcps.mpi.comm.PeerTimeout``: a rank waited longer than ``--timeout`` on another
      (``PeerDied``: or MPI failed a receive because its sender had died)
 6    ``hpcps.compress.codec.CodecError``: a corrupt compressed message
 7    :class:`NonFiniteError`: training produced a NaN or an infinity and was stopped
75    :data:`PREEMPTED_EXIT`: stopped early on SIGTERM or SIGUSR1 with a checkpoint written,
      or (:class:`CollectiveLost`) a peer of a lockstep strategy's collective never answered;
      resubmit (or requeue) the job with ``--resume auto`` to continue (``hpcps.runtime.stop``)
130   :data:`INTERRUPTED_EXIT`: interrupted (Ctrl-C), no checkpoint written (:func:`interrupted`)
====  ===============================================================================
"""

# "Checkpointed, resubmit me": BSD sysexits' EX_TEMPFAIL ("a temporary failure; the user is
# invited to retry"), far from the small codes above so a job script can tell it apart.
PREEMPTED_EXIT = 75
INTERRUPTED_EXIT = 130  # Ctrl-C (SIGINT), as a shell reports a process it interrupted


def interrupted(rank: int) -> None:
    """Ctrl-C reached this rank: one line for the job (rank 0's), no traceback. The same
    Ctrl-C often comes twice (from the terminal and forwarded by mpiexec): the second is
    ignored, so that it cannot break into the ending. Light (no NumPy, no MPI): it also
    serves a rank interrupted while it starts."""
    import signal
    import sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if rank == 0:
        print(f"hpcps: interrupted (Ctrl-C): the job ends with exit code {INTERRUPTED_EXIT}, "
              "without a checkpoint (SIGTERM or SIGUSR1 stop it with one)", file=sys.stderr,
              flush=True)


class HpcpsError(Exception):
    """Base class: a problem with what the user asked for, not a bug in hpcps."""

    exit_code = 1


class ConfigError(HpcpsError):
    """Unknown option or config key, bad value, impossible layout of ranks."""

    exit_code = 2


class DataError(HpcpsError):
    """Dataset missing, unreadable, or not in the layout hpcps expects."""

    exit_code = 3


class CheckpointError(HpcpsError):
    """Checkpoint missing, truncated, corrupt, or from an incompatible model."""

    exit_code = 4


class NonFiniteError(HpcpsError):
    """A training loss, gradient, update or parameter became NaN or infinite: the run diverged.

    Whoever sees it raises ``NonFiniteError(step, what)``, ``what`` saying what was not finite
    ("computed a training loss of nan on its own mini-batch"). ``train.py`` rewrites it with
    the rank's role, the checkpoint left in the run directory and the usual causes
    (``hpcps.strategies.context.explain_nonfinite``), prints it and aborts the job, so every
    rank ends. When several ranks see the same divergence (every replica of a synchronous
    step holds the same loss), all but the one that reports for the job wait ``defer_s``
    seconds before printing: the reporting rank's abort ends them first, and the job prints
    one message. A rank that is alone in seeing it still prints, ``defer_s`` later.
    """

    exit_code = 7

    def __init__(self, step: int, what: str, text: str | None = None, defer_s: float = 0.0):
        super().__init__(text or f"training diverged at step {step}: {what}")
        self.step, self.what, self.defer_s = step, what, defer_s


class CollectiveLost(HpcpsError):
    """A lockstep strategy (sync, averaging) waited ``--timeout`` for a collective that a
    dead or stuck peer never joined. Without ULFM a collective cannot drop a member, so the
    job ends as a preempted one does: the chief writes the checkpoint of the last step every
    replica completed (with P = 1 it holds the whole model) and the job exits 75, so that a
    requeue with ``--resume auto`` continues on the ranks that are left. The other ranks wait
    ``defer_s`` before they report, so that the chief's abort, once its checkpoint is
    written, ends them first.
    """

    exit_code = PREEMPTED_EXIT

    def __init__(self, text: str, defer_s: float = 0.0):
        super().__init__(text)
        self.defer_s = defer_s
