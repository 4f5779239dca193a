"""A strategy defined outside hpcps (tests/plugins/oneshot: one-shot averaging) is a full
strategy once registered with ``HPCPS_STRATEGIES``: ``--help`` lists it with its defaults, it
trains under ``mpiexec``, the combination matrix runs it, the report shows its runs, the scaling
model predicts it from the cost model it declares. Nothing in hpcps/ names it.

Also here: what needs no MPI works without mpi4py (``import hpcps.config``, every strategy's
declaration, ``python -m hpcps.train --help`` and ``--version``), checked with mpi4py blocked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mpirun import ROOT, train

PLUGINS = ROOT / "tests" / "plugins"
ENV = {"HPCPS_STRATEGIES": "oneshot",
       "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(ROOT), os.environ.get("PYTHONPATH", "")])}

# Put in front of a child's code: any import of mpi4py fails, as on a machine without MPI.
BLOCK_MPI = """
import sys
class _NoMPI:
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError("mpi4py is blocked for this test")
sys.meta_path.insert(0, _NoMPI())
"""


def python(code: str, *args: str, env: dict | None = None, timeout: float = 120):
    full = {**os.environ, **(env or {})}
    full.setdefault("PYTHONPATH", str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=full, timeout=timeout, cwd=ROOT)


def test_config_and_declarations_load_without_mpi():
    code = BLOCK_MPI + """
import hpcps.config as config
from hpcps.strategies.registry import strategies
names = list(strategies())
cfg = config.parse(["--strategy", "sync", "--lr", "0.1"])
assert cfg.lr == 0.1 and cfg.spec.name == "sync", cfg
assert not [m for m in sys.modules if m.startswith("mpi4py")]
print(",".join(names))
"""
    out = python(code)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.strip().split(",")) >= {"downpour", "sync", "averaging", "deadreckon",
                                                   "sandblaster"}, out.stdout


def test_the_block_is_real():
    """The blocker above does stop mpi4py (else the test before proves nothing)."""
    out = python(BLOCK_MPI + "import hpcps.mpi.comm\n")
    assert out.returncode != 0 and "mpi4py is blocked" in out.stderr, out.stderr[-500:]


def test_train_help_and_version_need_no_mpi():
    run = BLOCK_MPI + "import runpy; sys.argv = ['hpcps.train', *sys.argv[1:]]\n" \
        "runpy.run_module('hpcps.train', run_name='__main__')\n"
    helped = python(run, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "sandblaster options" in helped.stdout and "--n-fetch" in helped.stdout
    version = python(run, "--version")
    assert version.returncode == 0 and version.stdout.startswith("hpcps "), version


def test_a_plugin_is_listed_in_help_with_its_defaults():
    out = subprocess.run([sys.executable, "-m", "hpcps.train", "--help"], capture_output=True,
                         text=True, env={**os.environ, **ENV}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "oneshot options" in out.stdout, out.stdout[-2000:]
    assert "one-shot averaging" in out.stdout and "--lr 0.05" in out.stdout
    without = subprocess.run([sys.executable, "-m", "hpcps.train", "--help"],
                             capture_output=True, text=True, timeout=120)
    assert "oneshot" not in without.stdout  # registered only where asked for


def _installed_plugin(folder: Path, text: str) -> None:
    """A distribution in ``folder`` whose entry_points.txt is ``text`` (as pip installs it)."""
    info = folder / "oneshot_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: oneshot-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(text)


def test_an_installed_plugin_is_found_by_its_entry_point(tmp_path):
    """A distribution declaring the oneshot module under the ``hpcps.strategies`` entry-point
    group registers it (no HPCPS_STRATEGIES); the registry's look at the entry-point files,
    which spares importlib.metadata where no distribution names the group, agrees with
    importlib.metadata with and without such a distribution, and another group's entry
    point registers nothing."""
    installed, other = tmp_path / "installed", tmp_path / "other"
    _installed_plugin(installed, "[hpcps.strategies]\noneshot = oneshot\n")
    _installed_plugin(other, "[console_scripts]\noneshot = oneshot:main\n")
    code = """
import sys
from importlib.metadata import entry_points
from hpcps.strategies.registry import ENTRY_POINTS, installed_plugins, strategies
print(",".join(installed_plugins()))
print(",".join(ep.value for ep in entry_points(group=ENTRY_POINTS)))
print(",".join(strategies()))
"""
    for folder, want in ((installed, "oneshot"), (other, "")):
        path = os.pathsep.join([str(folder), str(PLUGINS), str(ROOT),
                                os.environ.get("PYTHONPATH", "")])
        env = {k: v for k, v in os.environ.items() if k != "HPCPS_STRATEGIES"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**env, "PYTHONPATH": path}, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        ours, theirs, names = out.stdout.splitlines()
        assert ours == theirs == want, out.stdout
        assert ("oneshot" in names.split(",")) == bool(want), names
    # where no distribution names the group, importlib.metadata is not even imported
    out = python("import sys; import hpcps.config\n"
                 "assert 'importlib.metadata' not in sys.modules, 'imported'\n")
    assert out.returncode == 0, out.stderr


def test_a_plugin_trains_and_reports(digits_h5, tmp_path):
    """3 replicas, and 2 replicas of 2 partitions: one-shot averaging on digits reached 88% at
    600 steps (2026-11-26); the bar leaves a margin for the seed and the oversubscribed cores."""
    for n, extra in ((3, []), (4, ["--partitions", "2"])):
        run_dir = tmp_path / f"n{n}"
        run = train(n, "--strategy", "oneshot", "--data", str(digits_h5), "--layers",
                    "64,32,10", "--steps", "600", "--eval-every", "0", "--run-dir",
                    str(run_dir), *extra, env=ENV, timeout=180)
        assert run.returncode == 0, run.output[-3000:]
        summary = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                   .splitlines() if '"kind": "summary"' in line][-1]
        assert summary["strategy"] == "oneshot" and summary["step"] >= 600, summary
        assert summary["test_accuracy"] >= 0.8, summary["test_accuracy"]
        assert "replicas' RMS distance to their average" in run.stdout
    report = subprocess.run([sys.executable, "-m", "hpcps.report", str(tmp_path / "n3"),
                             "--out", str(tmp_path / "report")], capture_output=True, text=True,
                            env={**os.environ, **ENV}, timeout=120)
    assert report.returncode == 0, report.stderr
    row = next(line for line in report.stdout.splitlines() if "| oneshot" in line)
    assert "finished" in row and "600" in row, row


def test_the_combination_matrix_runs_a_plugin(tmp_path):
    """The matrix builds the plug-in's rows from its declaration alone; two of them run."""
    env = {**os.environ, **ENV, "HPCPS_COMBINATIONS_ONLY": "oneshot"}
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "-n", "0", "tests/test_combinations.py::"
                             "test_combination"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    ids = [line for line in listed.stdout.splitlines() if "test_combination[oneshot-" in line]
    assert len(ids) >= 6, listed.stdout[-2000:] + listed.stderr[-2000:]
    chosen = [ids[0], next(i for i in ids if "-P2-" in i or "-P3-" in i)]
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "0", *chosen], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert ran.returncode == 0 and "2 passed" in ran.stdout, ran.stdout[-3000:]


# Shared modules that still name a strategy (none: the scaling model reads each strategy's
# declared cost model).
NAMES_STILL_IN: set[str] = set()


# A declaration without a cost model, registered beside the plug-in: the scaling tool lists it.
NO_COST = """
from hpcps.options import LOOP_OPTIONS, check_loop_options
from hpcps.strategies.registry import Strategy

STRATEGY = Strategy(name="nocost", help="a declaration without a cost model",
                    roles={"replica": "oneshot.replica:run"}, options=LOOP_OPTIONS,
                    validate=check_loop_options)
"""


def test_a_plugin_is_in_the_scaling_model(tmp_path):
    """``python -m hpcps.scaling`` lists the plug-in in --help and predicts it from its cost
    model (compute-only steps, one allreduce at the end of --run-steps steps: close to linear,
    and below it); a registered strategy that declares no cost model is listed as such."""
    (tmp_path / "nocost.py").write_text(NO_COST)
    env = {**os.environ, **ENV, "HPCPS_STRATEGIES": "oneshot,nocost",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    helped = subprocess.run([sys.executable, "-m", "hpcps.scaling", "--help"],
                            capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert helped.returncode == 0, helped.stderr
    assert "oneshot" in helped.stdout and "--layers" in helped.stdout, helped.stdout
    args = ["--layers", "64,32,10", "--nodes", "1,4,64", "--network", "1gbe", "--png", "",
            "--run-steps", "100"]
    ran = subprocess.run([sys.executable, "-m", "hpcps.scaling", *args, "--json"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout)
    assert out["no_cost_model"] == ["nocost"], out["no_cost_model"]
    one, four, many = out["curves"]["oneshot"]
    assert one["examples_per_s"] > 0 and one["speedup"] == 1.0, one
    assert 3.0 < four["speedup"] < 4.0 and many["speedup"] < 64, (four, many)
    table = subprocess.run([sys.executable, "-m", "hpcps.scaling", *args], capture_output=True,
                           text=True, env=env, timeout=300, cwd=ROOT)
    assert table.returncode == 0, table.stderr[-3000:]
    header = next(line for line in table.stdout.splitlines() if line.startswith("nodes"))
    assert "oneshot" in header and "nocost" not in header, header
    assert "nocost: no cost model declared" in table.stdout, table.stdout


def test_cost_models_load_and_predict_without_mpi():
    """Every declared cost model (the plug-in's too) is pure: predictions with mpi4py
    blocked."""
    code = BLOCK_MPI + """
from hpcps.tools import scaling
w = scaling.Workload(n_params=100_000, batch=32, compute_s=1e-3, run_steps=1000)
names = scaling.modelled()
for name in names:
    assert scaling.predict(name, w, 8, 2e-5, 1e-9) > 0, name
    assert scaling.bytes_per_step(name, w, 8) >= 0, name
assert not [m for m in sys.modules if m.startswith("mpi4py")]
print(",".join(names))
"""
    out = python(code, env=ENV)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.strip().split(",")) == {"downpour", "sync", "averaging", "deadreckon",
                                                   "sandblaster", "oneshot"}, out.stdout


def test_no_strategy_name_in_the_shared_code():
    """Only a strategy's own package names it: the registry, config, the job and the tools
    read declarations (but for NAMES_STILL_IN)."""
    names = ("downpour", "sandblaster", "deadreckon", "averaging")
    shared = [p for p in (ROOT / "hpcps").rglob("*.py")
              if "strategies" not in p.relative_to(ROOT / "hpcps").parts[:1]]
    found = {}
    for path in shared:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in names:
                if f'"{name}"' in code or f"'{name}'" in code:
                    found.setdefault(str(path.relative_to(ROOT)), []).append(i)
    assert set(found) == NAMES_STILL_IN, found


def test_the_plugin_folder_is_outside_hpcps():
    assert not (Path(ROOT) / "hpcps" / "strategies" / "oneshot").exists()


def test_a_plugin_that_cannot_be_imported_is_refused_in_one_line(tmp_path):
    """A misspelt ``HPCPS_STRATEGIES`` is bad input, not a bug: the run and ``--help`` end with
    exit code 2 and one ``hpcps: error`` line naming the module, not a traceback per rank."""
    env = {"HPCPS_STRATEGIES": "oneshot,no_such_strategy_module", "PYTHONPATH": ENV["PYTHONPATH"]}
    run = train(3, "--strategy", "sync", "--run-dir", str(tmp_path / "r"), env=env, timeout=60)
    helped = train(2, "--help", env=env, timeout=60)
    for launch in (run, helped):
        errors = [line for line in launch.stderr.splitlines() if line.startswith("hpcps: error")]
        assert launch.returncode == 2, launch.output[-2000:]
        assert len(errors) == 1 and "'no_such_strategy_module'" in errors[0], launch.stderr
        assert "Traceback" not in launch.output, launch.output[-2000:]
