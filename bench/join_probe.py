"""Can a second launch connect to a running job? MPI_Open_port / MPI_Comm_accept on a job's
rank, MPI_Comm_connect from a rank of another ``mpiexec``; one JSON object.

The job (``--role job``, started by this script under its own ``mpiexec -n 1``) opens a port,
writes its name to a file, accepts on COMM_SELF, receives a message over the
intercommunicator and answers; the newcomer (``--role newcomer``, a second ``mpiexec -n 1``)
reads the file, connects and exchanges the two messages. This is the MPI mechanism a join
would need (``docs/fault-tolerance.md``, "Not implemented"); hpcps does not use it yet.

Usage::

    python bench/join_probe.py            # {"connected": true, "accept_s": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIMIT_S = 60.0


def job(port_file: Path) -> None:
    from mpi4py import MPI
    port = MPI.Open_port()
    port_file.write_text(port)
    t0 = time.monotonic()
    inter = MPI.COMM_SELF.Accept(port)
    got = inter.recv(source=0, tag=1)
    inter.send("welcome", dest=0, tag=2)
    print(json.dumps({"accept_s": round(time.monotonic() - t0, 3), "job_got": got,
                      "remote_size": inter.Get_remote_size()}), flush=True)
    inter.Disconnect()
    MPI.Close_port(port)


def newcomer(port_file: Path) -> None:
    from mpi4py import MPI
    deadline = time.monotonic() + LIMIT_S
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise SystemExit("no port published")
        time.sleep(0.05)
    t0 = time.monotonic()
    inter = MPI.COMM_SELF.Connect(port_file.read_text())
    inter.send("hello", dest=0, tag=1)
    got = inter.recv(source=0, tag=2)
    print(json.dumps({"connect_s": round(time.monotonic() - t0, 3), "newcomer_got": got}),
          flush=True)
    inter.Disconnect()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("job", "newcomer"))
    ap.add_argument("--port-file")
    args = ap.parse_args(argv)
    if args.role == "job":
        job(Path(args.port_file))
        return 0
    if args.role == "newcomer":
        newcomer(Path(args.port_file))
        return 0
    from mpi4py import MPI
    mpiexec = shutil.which("mpiexec") or "mpiexec"
    tmp = Path(tempfile.mkdtemp(prefix="hpcps-join-probe-"))
    port_file = tmp / "port"
    me = [sys.executable, os.path.abspath(__file__), "--port-file", str(port_file)]
    first = subprocess.Popen([mpiexec, "-n", "1", *me, "--role", "job"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    second = subprocess.Popen([mpiexec, "-n", "1", *me, "--role", "newcomer"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    outs = []
    for proc in (first, second):
        try:
            outs.append(proc.communicate(timeout=LIMIT_S)[0])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # this probe's own launch (its own session)
            outs.append(proc.communicate()[0] + "\n(timed out)")
    figures: dict = {"mpi": MPI.Get_library_version().splitlines()[0].strip(" \0"),
                     "exit_codes": [first.returncode, second.returncode]}
    for out in outs:
        for line in out.splitlines():
            if line.startswith("{"):
                figures.update(json.loads(line))
    figures["connected"] = (figures.get("job_got") == "hello"
                            and figures.get("newcomer_got") == "welcome")
    if not figures["connected"]:
        figures["output"] = [o[-1500:] for o in outs]
    print(json.dumps(figures, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if figures["connected"] else 1


if __name__ == "__main__":
    sys.exit(main())
