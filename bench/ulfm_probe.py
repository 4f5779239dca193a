"""Probe what the MPI library does when a rank is SIGKILLed during a loop of allreduces.

Launches this file on 4 ranks; rank 2 SIGKILLs itself at iteration ``--kill-at`` of a loop of
``MPI_Allreduce`` calls (0.01 s apart). Each survivor reports, as one JSON line:

* whether its allreduce returned an error, which error class (``MPI.ERR_PROC_FAILED``, ULFM's
  ``MPIX_ERR_PROC_FAILED``, or another) and how long after its last good allreduce,
* whether ``Comm.Revoke``, ``Comm.Ack_failed``/``Get_failed`` (which ranks failed),
  ``Comm.Shrink`` and ``Comm.Agree`` work, and
* whether 10 more allreduces on the shrunk communicator give the 3 survivors' sum.

A survivor that hangs reports nothing: the launch has a hard time limit (``--timeout``),
after which its whole process tree is killed (``tests/mpirun.py``'s ``end_launch``).

The driver runs one launch per configuration of the MPI beside this Python (``mpiexec
--version`` tells Open MPI from MPICH) and prints one JSON object: per configuration the
command, the launcher's exit code, the seconds it took, and each survivor's report.

Configurations
--------------
Open MPI: ``plain`` (``mpirun -n 4``) and ``ulfm`` (``mpirun --with-ft ulfm -n 4``).
MPICH: ``plain`` (``mpiexec -n 4``), ``no-cleanup`` (``-disable-auto-cleanup``) and ``ft``
(``-disable-auto-cleanup`` with ``MPIR_CVAR_ENABLE_FT=1``).

Usage::

    /path/to/venv/bin/python bench/ulfm_probe.py              # every configuration
    /path/to/venv/bin/python bench/ulfm_probe.py --only ulfm --timeout 60
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N = 4
VICTIM = 2
TAG = "ULFM_PROBE "


# -- the rank program ---------------------------------------------------------------------------
def rank_main(kill_at: int, iterations: int) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)  # mpi4py raises MPI.Exception for the error codes
    rank = comm.Get_rank()
    out: dict = {"rank": rank, "size": comm.Get_size(),
                 "library": MPI.Get_library_version().splitlines()[0].strip(" \0")}

    def report():
        print(TAG + json.dumps(out), flush=True)

    def error_of(exc: Exception) -> dict:
        if isinstance(exc, MPI.Exception):
            cls = exc.Get_error_class()
            name = {MPI.ERR_PROC_FAILED: "ERR_PROC_FAILED", MPI.ERR_REVOKED: "ERR_REVOKED",
                    MPI.ERR_PROC_FAILED_PENDING: "ERR_PROC_FAILED_PENDING"}.get(cls)
            return {"class": cls, "name": name, "string": exc.Get_error_string().strip()}
        return {"class": None, "name": type(exc).__name__, "string": str(exc)}

    buf, got = np.zeros(1), np.zeros(1)
    last_ok = time.monotonic()
    out["loop"] = "completed"
    for i in range(iterations):
        if rank == VICTIM and i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        buf[0] = rank + 1
        try:
            comm.Allreduce(buf, got, op=MPI.SUM)
        except Exception as exc:  # noqa: BLE001 - report whatever the library raised
            out.update(loop="error", at_iteration=i, error=error_of(exc),
                       detected_s=round(time.monotonic() - last_ok, 3))
            break
        last_ok = time.monotonic()
        time.sleep(0.01)
    if out["loop"] == "completed":
        out["at_iteration"] = iterations
        report()
        return
    report()  # what the failure looked like, before trying to recover (which may hang)

    steps = {}
    try:
        comm.Revoke()
        steps["revoke"] = "ok"
    except Exception as exc:  # noqa: BLE001
        steps["revoke"] = error_of(exc)
    try:
        comm.Ack_failed()
        steps["failed_ranks"] = sorted(MPI.Group.Translate_ranks(
            comm.Get_failed(), list(range(comm.Get_failed().Get_size())),
            comm.Get_group()))
    except Exception as exc:  # noqa: BLE001
        steps["failed_ranks"] = error_of(exc)
    out["recovery"] = steps
    report()
    try:
        t0 = time.monotonic()
        new = comm.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        steps["shrink"] = {"size": new.Get_size(), "new_rank": new.Get_rank(),
                           "seconds": round(time.monotonic() - t0, 3)}
    except Exception as exc:  # noqa: BLE001
        steps["shrink"] = error_of(exc)
        report()
        return
    report()
    try:
        steps["agree"] = int(new.Agree(1))
    except Exception as exc:  # noqa: BLE001
        steps["agree"] = error_of(exc)
    try:
        sums = []
        for _ in range(10):
            buf[0] = rank + 1
            new.Allreduce(buf, got, op=MPI.SUM)
            sums.append(float(got[0]))
        expected = float(sum(r + 1 for r in range(N) if r != VICTIM))
        steps["allreduce_after"] = {"sums": sorted(set(sums)), "expected": expected,
                                    "ok": all(s == expected for s in sums)}
    except Exception as exc:  # noqa: BLE001
        steps["allreduce_after"] = error_of(exc)
    report()
    try:
        new.Barrier()
    except Exception:  # noqa: BLE001
        pass
    # MPI_Finalize with a dead rank in COMM_WORLD may wait or fail: leave without it
    sys.stdout.flush()
    os._exit(0)


# -- the driver ---------------------------------------------------------------------------------
def configurations(flavor: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (launcher flags after the launcher, extra environment)."""
    if flavor == "openmpi":
        return {"plain": ([], {}), "ulfm": (["--with-ft", "ulfm"], {})}
    return {"plain": ([], {}), "no-cleanup": (["-disable-auto-cleanup"], {}),
            "ft": (["-disable-auto-cleanup"], {"MPIR_CVAR_ENABLE_FT": "1"})}


def run_one(flags: list[str], env_extra: dict, args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from mpirun import end_launch, launch_flags, mpiexec, tagged_env
    cmd = [mpiexec(), *launch_flags(), *flags, "-n", str(N), sys.executable, __file__,
           "--rank", "--kill-at", str(args.kill_at), "--iterations", str(args.iterations)]
    env, tag = tagged_env({**os.environ, "OPENBLAS_NUM_THREADS": "1", **env_extra})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        end_launch(proc.pid, tag)
        out, err = proc.communicate()
    reports: dict[int, dict] = {}
    for line in out.splitlines():
        if line.startswith(TAG):
            rec = json.loads(line[len(TAG):])
            reports[rec["rank"]] = rec  # the last report of each rank is its fullest
    shown = " ".join([*(f"{k}={v}" for k, v in env_extra.items()), Path(cmd[0]).name,
                      *launch_flags(), *flags, "-n", str(N)])
    return {"command": f"{shown} python bench/ulfm_probe.py --rank ...",
            "env": env_extra, "exit_code": None if timed_out else proc.returncode,
            "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2),
            "survivors": [reports[r] for r in sorted(reports)],
            "stderr_tail": err[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=int, default=50, help="iteration rank 2 dies at")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per launch")
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    args = ap.parse_args()
    if args.rank:
        rank_main(args.kill_at, args.iterations)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from mpirun import mpi_flavor
    flavor = mpi_flavor()
    results = {"mpi": flavor, "date": time.strftime("%Y-%m-%d"), "configurations": {}}
    for name, (flags, env_extra) in configurations(flavor).items():
        if args.only and name not in args.only:
            continue
        print(f"ulfm_probe: {flavor} {name} ...", file=sys.stderr, flush=True)
        results["configurations"][name] = run_one(flags, env_extra, args)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
