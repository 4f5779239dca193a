"""Waiting on other ranks without ever hanging silently.

Every wait in hpcps goes through :func:`wait_all`: it polls the requests, yields the core
between polls (ranks are often oversubscribed, and a rank spinning in MPI steals the CPU the
rank it waits for needs), and after ``timeout`` seconds raises :class:`PeerTimeout` naming
what, and which rank, it waited for.
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from hpcps.errors import HpcpsError


class PeerTimeout(HpcpsError):
    """Another rank did not answer in time."""

    exit_code = 5


class Poller:
    """Back-off between polls: yield at first, then sleep a little longer each idle round."""

    def __init__(self):
        self.idle = 0

    def reset(self) -> None:
        self.idle = 0

    def pause(self) -> None:
        self.idle += 1
        if self.idle < 200:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, 1e-5 * (self.idle - 199)))


def wait_all(reqs, timeout: float, what: str) -> None:
    """Complete every request in ``reqs`` or raise PeerTimeout after ``timeout`` seconds."""
    if MPI.Request.Testall(reqs):
        return
    deadline = time.monotonic() + timeout
    poll = Poller()
    while not MPI.Request.Testall(reqs):
        if time.monotonic() > deadline:
            raise PeerTimeout(f"waited {timeout:.0f} s for {what}; that rank is stuck or dead "
                              "(raise --timeout if it is only slow)")
        poll.pause()
