"""A run across hosts without Slurm: ``mpiexec -f HOSTFILE`` (the mpich wheel's Hydra) on two
emulated hosts, the network namespaces of bench/cluster/netns.sh, as docs/hosts.md describes.

Hydra starts its proxy on each host through a launcher: ``-launcher ssh -launcher-exec
bench/cluster/launch.sh``, which is called as ssh would be ("HOST COMMAND") and runs the
command inside HOST's namespace (``-launcher fork`` would start every proxy on this machine's
own network, whatever the host file says). ``-iface hpcps-br`` is the interface the proxies
connect back on; ``MPIR_CVAR_NOLOCAL=1`` because the namespaces share this machine's host
name and /dev/shm, which real hosts do not.

Needs root, iproute2 and the tbf qdisc (the same as tests/test_cluster.py); skipped with the
reason otherwise, and while another emulated cluster is up."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "bench" / "cluster"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SMALL = ["--layers", "64,32,10", "--batch-size", "16", "--progress-every", "0.5",
         "--eval-every", "100", "--timeout", "60"]
# what tells the mpich wheel's library which interface carries MPI between the hosts, for
# each of its two network modules (UCX is the default; docs/hosts.md). UCX_TLS=tcp keeps UCX
# off the shared memory the namespaces share, so that the test crosses the veth links.
NETMODS = {"ucx": {"UCX_NET_DEVICES": "eth0", "UCX_TLS": "tcp"},
           "ofi": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}}


def _ours() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = [line for line in out.splitlines() if ": hpcps-" in line]
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return links + [line for line in spaces.splitlines() if line.startswith("hpcps-h")]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    if not MPIEXEC.exists():
        return f"no mpiexec beside {sys.executable} (the mpich wheel's)"
    if _ours():
        return "an emulated cluster is already up (a bench is running)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


@pytest.fixture(scope="module")
def two_hosts(emulated_hosts_to_ourselves):
    netns = str(CLUSTER / "netns.sh")
    try:
        subprocess.run([netns, "up", "2", "10gbit"], check=True, timeout=60)
        yield
    finally:
        subprocess.run([netns, "down"], timeout=60)
        assert _ours() == []


def mpiexec(hostfile: Path, n: int, *cmd, netmod: str, timeout: float = 120):
    env = dict(os.environ, MPIR_CVAR_NOLOCAL="1", HPCPS_CLUSTER_PIN="0", **NETMODS[netmod],
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([str(MPIEXEC), "-f", str(hostfile), "-iface", "hpcps-br",
                           "-launcher", "ssh", "-launcher-exec", str(CLUSTER / "launch.sh"),
                           "-n", str(n), *map(str, cmd)],
                          capture_output=True, text=True, timeout=timeout, env=env)


WHERE = ("import subprocess; from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "a = [x.split()[3] for x in subprocess.run(['ip', '-o', '-4', 'addr'], "
         "capture_output=True, text=True).stdout.splitlines() if '10.77.' in x]; "
         "got = c.gather((c.rank, a)); c.rank or print(sorted(got)); "
         "c.allreduce(1)")


@pytest.mark.parametrize("netmod", ["ucx", "ofi"])
def test_a_hostfile_places_the_ranks_and_hpcps_trains_across_them(two_hosts, netmod,
                                                                 digits_h5, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.77.0.1:2\n10.77.0.2:2\n")   # Hydra's "host:ranks"
    where = mpiexec(hostfile, 4, sys.executable, "-c", WHERE, netmod=netmod)
    assert where.returncode == 0, where.stderr[-3000:]
    # ranks fill each host's count in turn: 0 and 1 on the first host, 2 and 3 on the second
    assert where.stdout.strip().splitlines()[-1] == str(
        [(0, ["10.77.0.1/24"]), (1, ["10.77.0.1/24"]), (2, ["10.77.0.2/24"]),
         (3, ["10.77.0.2/24"])]), where.stdout
    # the dataset and the run directory on a file system every host sees (here: one machine's)
    run_dir = tmp_path / "run"
    run = mpiexec(hostfile, 4, sys.executable, "-m", "hpcps.train", "--strategy", "sync",
                  "--data", digits_h5, "--steps", "200", "--run-dir", run_dir, *SMALL,
                  netmod=netmod)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["step"] == 200 and summary["test_accuracy"] > 0.5, summary
    assert next(r for r in records if r["kind"] == "start")["ranks"] == 4
