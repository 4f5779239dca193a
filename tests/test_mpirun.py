"""The suite's launch helpers: a hung launch's whole tree ends, and reads have deadlines."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import descendants, end_launch, mpiexec, read_line, read_until, tagged, tagged_env


HUNG = """
import signal, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, signal.SIG_IGN)
time.sleep(600)
"""


def test_end_launch_ends_hydras_proxies_and_the_ranks():
    """The ranks of ``mpiexec -n 2`` hang, and so does Hydra's proxy (stopped, as a proxy
    stuck in a system call would be: a live proxy kills its ranks itself once mpiexec
    dies). The proxy and the ranks are in sessions of their own, so killing mpiexec's process
    group leaves them; end_launch leaves none of the processes carrying the launch's tag, and
    kills nobody else's."""
    env, tag = tagged_env()
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-c", HUNG], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(tagged(tag)) < 4:  # mpiexec, a proxy, two ranks
            assert time.monotonic() < deadline, f"launch did not start: {tagged(tag)}"
            time.sleep(0.1)
        for pid in descendants(proc.pid):
            if b"hydra_pmi_proxy" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGSTOP)
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        end_launch(proc.pid, tag)
        proc.wait(timeout=30)
        time.sleep(1)  # time for anything left to be seen
        assert tagged(tag) == [] and bystander.poll() is None
        bystander.kill()
        bystander.wait()
    finally:
        end_launch(proc.pid, tag)
        proc.wait()


def test_reads_end_at_their_deadline():
    r, w = os.pipe()
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="nothing more within 0.5 s"):
            read_line(r, 0.5)
        assert time.monotonic() - t0 < 5
        os.write(w, b"ready\nmore")
        assert read_line(r, 5) == "ready"
        os.close(w)
        w = None
        assert read_until(r, 5) == b""  # the rest went with the first read; then end of file
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
