"""A full disk's stand-in for a test's subprocess: a limit on the size of the files it writes."""
from __future__ import annotations

import resource
import signal


def limited_to(nbytes: int):
    """A ``preexec_fn``: the command may not write a file past ``nbytes`` (RLIMIT_FSIZE, what
    ``ulimit -f`` sets); such a write fails with EFBIG, "File too large", as one past a full
    disk fails with ENOSPC."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit
