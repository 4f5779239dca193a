"""The emulated cluster (bench/cluster): hosts come up as network namespaces, MPI runs over
TCP between them, and nothing is left behind, also when the bench is stopped midway.

Needs root, iproute2 (ip, tc) and the tbf qdisc; skipped with the reason otherwise, and
while another emulated cluster is up (a bench running on this machine)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import end_launch

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "bench" / "cluster"


def _hosts() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("hpcps-h")]


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(": ")[1].split("@")[0] for line in out.splitlines()
            if ": hpcps-" in line]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    if _hosts() or _links():
        return "an emulated cluster is already up (a bench is running)"
    return None


pytestmark = [pytest.mark.skipif(_why_not() is not None, reason=str(_why_not())),
              pytest.mark.usefixtures("emulated_hosts_to_ourselves")]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_two_hosts_talk_mpi_over_the_shaped_link_and_go_away():
    netns = str(CLUSTER / "netns.sh")
    try:
        subprocess.run([netns, "up", "2", "1gbit"], check=True, timeout=60)
        assert sorted(_hosts()) == ["hpcps-h1", "hpcps-h2"]
        qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "rate 1Gbit" in qdiscs
        run = subprocess.run([str(CLUSTER / "mpiexec.sh"), "-n", "2", sys.executable,
                              str(CLUSTER / "pingpong.py"), "--repeats", "3", "--mib", "2"],
                             capture_output=True, text=True, timeout=120, env=_env())
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        # shaped to 1 Gb/s: MPI sees at most that (TCP over veth unshaped gives several),
        # between the pair and in the ring of both ranks sending at once
        assert 0 < got["bandwidth_gbit_s"] < 1.05, got
        assert 0 < got["ring"]["bandwidth_gbit_s"] < 1.05 and got["ring"]["alpha_s"] > 0, got
        # each host pinned to its own core (host k to core k-1 mod nproc), or not at all
        where = "import os; print(sorted(os.sched_getaffinity(0)))"
        for pin, expect in (("1", {str([k % os.cpu_count()]) for k in range(2)}),
                            ("0", {str(sorted(os.sched_getaffinity(0)))})):
            run = subprocess.run([str(CLUSTER / "mpiexec.sh"), "-n", "2", sys.executable, "-c",
                                  where], capture_output=True, text=True, timeout=60,
                                 env=dict(_env(), HPCPS_CLUSTER_PIN=pin))
            assert run.returncode == 0, run.stderr[-3000:]
            # the two ranks' lines may reach mpiexec's output interleaved
            assert set(re.findall(r"\[[0-9, ]+\]", run.stdout)) == expect, (pin, run.stdout)
        too_many = subprocess.run([str(CLUSTER / "mpiexec.sh"), "-n", "3", "true"],
                                  capture_output=True, text=True, timeout=30)
        assert too_many.returncode == 2 and "2 emulated hosts are up" in too_many.stderr
    finally:
        subprocess.run([netns, "down"], timeout=60)
    assert _hosts() == [] and _links() == []


def test_a_bench_stopped_midway_leaves_no_host_behind(tmp_path):
    proc = subprocess.Popen([sys.executable, str(CLUSTER / "bench_cluster.py"), "--networks",
                             "1gbit", "--ranks", "2", "--strategies", "sync", "--only",
                             "throughput", "--steps", "100000", "--data",
                             str(tmp_path / "missing.h5")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _hosts():  # waiting on bench_cluster.py (pid proc.pid) to bring hosts up
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "bench_cluster.py brought no host up in 60 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            end_launch(proc.pid)
            subprocess.run([str(CLUSTER / "netns.sh"), "down"], timeout=60)
    assert proc.returncode != 0
    assert _hosts() == [] and _links() == []
