"""What the cost models' inputs measure on this CPU: a mini-batch's pass and the optimizer's
update as a replica runs them, the allreduce's sum, how much slower a pass runs with every
core computing, and each strategy's own figures (its cost model's ``calibrate`` hook, run on
the same model, state and inputs)."""
from __future__ import annotations

import os
import queue
import statistics
import time
from dataclasses import fields, replace

import numpy as np

from hpcps.errors import DataError
from hpcps.strategies.cost import Bench, Workload, rng_normal
from hpcps.strategies.registry import load
from hpcps.tools.scaling.model import models


def sample_inputs(layers: list[int], rows: int, data: str | None = None):
    """``rows`` examples to time with, and what they are: the first rows of ``data``'s
    training split (an hpcps HDF5 dataset) when given, else dense standard-normal inputs
    (no zeros: the slowest case for the first layer, which skips zero inputs)."""
    if data:
        from hpcps.io.data.h5format import load_split, open_dataset
        info = open_dataset(data)
        if info.n_features != layers[0]:
            raise DataError(f"{data}: rows of {info.n_features} features, but the model's "
                            f"first layer takes {layers[0]} (--layers)")
        x, y = load_split(data, "train", 0, max(1, info.n_train // rows))
        x, y = x[:rows], y[:rows] % layers[-1]
        reps = -(-rows // len(x))  # a file of fewer rows: use them again
        x, y = np.ascontiguousarray(np.tile(x, (reps, 1))[:rows]), np.tile(y, reps)[:rows]
        what = f"{rows} rows of {info.name} ({100 * float(np.mean(x == 0)):.0f}% zeros)"
    else:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((rows, layers[0])).astype(np.float32)
        y = rng.integers(0, layers[-1], rows)
        what = "dense random inputs (no zeros to skip)"
    return x, np.ascontiguousarray(y, dtype=np.int64), what


WARM_STEPS = 3  # steps measure_compute takes before it times (the first run cold)


def calibrations() -> list[str]:
    """The strategies' own measurements (``CostModel.calibrate``), each once, in the
    registry's order."""
    hooks: list[str] = []
    for m in models().values():
        if m is not None and m.calibrate and m.calibrate not in hooks:
            hooks.append(m.calibrate)
    return hooks


def measure_compute(layers: list[int], batch: int, repeats: int = 15,
                    portion: int = 512, data: str | None = None, start=None,
                    pass_only: bool = False) -> dict:
    """One mini-batch's forward and backward pass and an Adagrad update, on this CPU, one
    thread, medians of ``repeats`` steps taken as a replica takes them (pass, update; after
    ``WARM_STEPS``), the work per float of an allreduce's sum (``reduce_s_per_param``), and
    what each registered strategy's cost model measures on its own code (:func:`calibrations`,
    handed a :class:`~hpcps.strategies.cost.Bench`: the same model, state and inputs):
    ``compute_s`` and the per-parameter figures in CPU seconds (what the work costs a core of
    its own, also on a loaded machine), ``compute_wall_s`` in wall seconds (what it took
    here, sharing the cores), and the load average then.

    The pass runs the code a replica runs (:class:`hpcps.strategies.gradients.GradientSource`
    at one thread): the compiled engine's ``loss_and_grad`` when it is built (its first layer
    skips zero inputs, its sgemm is the BLAS ``HPCPS_BLAS`` chooses), NumPy's otherwise, each
    repeat on the next mini-batch of :func:`sample_inputs` (``data``: the user's rows, whose
    zeros the first layer skips); ``portion`` rows are there for a batch method's portion.
    ``path`` says which code and inputs were measured; ``start``, when given, is called just
    before the first step (:func:`measure_together` lines processes up with it);
    ``pass_only`` returns ``compute_s`` and ``compute_wall_s`` alone, measuring nothing else."""
    from hpcps.engine import hogwild
    from hpcps.model.mlp import MLP
    from hpcps.model.optim import Adagrad
    model = MLP(layers, "relu")
    params = model.init_params(0)
    x, y, inputs = sample_inputs(layers, max(portion, batch * (WARM_STEPS + repeats)), data)
    grad = np.empty_like(params)
    if hogwild.HAVE_EXTENSION:
        from hpcps.kernels import blas
        engine = hogwild.HogwildEngine(layers, "relu", threads=1, batch=batch)
        step = engine.loss_and_grad
        skip = engine.zero_skip_isa
        skipping = f"first layer skips zeros, {skip}" if skip else "no zero skipping"
        path = f"compiled engine ({skipping}; sgemm: {blas.current()})"
    else:
        step = model.loss_and_grad
        path = "NumPy (compiled kernels not built)"
    opt = Adagrad(0.01)
    state = opt.init_state(model.n_params)
    cpu, wall, upd = [], [], []
    if start is not None:
        start()
    for i in range(WARM_STEPS + repeats):  # steps as a replica takes them: pass, update
        j = i % (len(x) // batch)
        xb, yb = x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch]
        w, c = time.perf_counter(), time.process_time()
        step(params, xb, yb, grad=grad)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
        grad *= np.float32(1e-3)
        c = time.process_time()
        opt.apply(params, grad, state)
        upd.append(time.process_time() - c)
    cpu, wall, upd = cpu[WARM_STEPS:], wall[WARM_STEPS:], upd[WARM_STEPS:]
    if pass_only:
        return {"compute_s": statistics.median(cpu), "compute_wall_s": statistics.median(wall)}
    n = model.n_params
    other = rng_normal(n, 1)
    red = []
    for _ in range(repeats):
        c = time.process_time()
        np.add(grad, other, out=grad)
        red.append(time.process_time() - c)
    bench = Bench(layers=layers, batch=batch, repeats=repeats, warm_steps=WARM_STEPS,
                  model=model, params=params, state=state, x=x, y=y, step=step,
                  portion=portion)
    own: dict = {}
    for hook in calibrations():
        own.update(load(hook)(bench))
    return {"compute_s": statistics.median(cpu),
            "compute_wall_s": statistics.median(wall),
            "update_s_per_param": statistics.median(upd) / model.n_params,
            "reduce_s_per_param": statistics.median(red) / n,
            **own,
            "path": f"{path}, on {inputs}",
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0}


def _measure_beside(index, core, barrier, results, layers, batch, repeats, data,
                    rounds) -> None:
    """One of measure_together's processes: per round, process 0 alone (the others wait at
    the barrier, blocked), then all at once."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    for _ in range(rounds):
        alone = measure_compute(layers, batch, repeats, data=data,
                                pass_only=True)["compute_s"] if index == 0 else None
        barrier.wait()
        together = measure_compute(layers, batch, repeats, data=data, start=barrier.wait,
                                   pass_only=True)["compute_s"]
        results.put((index, alone, together))


def _start_with_this_blas(procs, have_extension: bool) -> None:
    """Start ``procs`` (spawned: each copies os.environ when it starts) with HPCPS_BLAS set to
    the library this process chose, so the children measure the same BLAS; this process's
    environment is put back as it was, so later launches keep their own choice."""
    if not have_extension:
        for p in procs:
            p.start()
        return
    from hpcps.kernels import blas
    before = os.environ.get(blas.ENV)
    os.environ[blas.ENV] = blas.current()
    try:
        for p in procs:
            p.start()
    finally:
        if before is None:
            del os.environ[blas.ENV]
        else:
            os.environ[blas.ENV] = before


def measure_together(layers: list[int], batch: int, processes: int, repeats: int = 30,
                     data: str | None = None, rounds: int = 3,
                     timeout: float = 600.0) -> dict:
    """How much slower a mini-batch's pass runs on this machine when ``processes`` processes
    (its cores) run it at once than when one runs alone: cores that share a physical core,
    a cache or the memory bus slow each other down, which a fair share of the cores does
    not say. Each of ``rounds`` times one process measures alone, then all of them at once
    (starting their steps together at a barrier), each pinned to a core of its own where
    the system can pin (else two could share a core until the scheduler moves one, which
    takes longer than the measurement), with the BLAS this process uses. Returns the
    medians over the rounds of the time alone, of the processes' median together, and of
    their ratio, ``slowdown`` (at least 1): alternating rounds keep a machine's drift out
    of the ratio."""
    import multiprocessing as mp

    from hpcps.engine import hogwild
    if processes < 2:
        alone = measure_compute(layers, batch, repeats, data=data, pass_only=True)["compute_s"]
        return {"processes": processes, "alone_s": alone, "together_s": alone, "slowdown": 1.0}
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    procs = [ctx.Process(target=_measure_beside,
                         args=(i, cores[i % len(cores)] if cores else None, barrier, results,
                               layers, batch, repeats, data, rounds), daemon=True)
             for i in range(processes)]
    _start_with_this_blas(procs, hogwild.HAVE_EXTENSION)
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < rounds * processes:
            try:
                got.append(results.get(timeout=0.5))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"measure_together: a measuring process failed (exit "
                                       f"codes {dead}) or took over {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    alone = [a for i, a, _ in got if i == 0]
    together = [statistics.median(t for _, _, t in got[r * processes:(r + 1) * processes])
                for r in range(rounds)]
    ratios = [t / a for t, a in zip(together, alone)]
    return {"processes": processes, "alone_s": statistics.median(alone),
            "together_s": statistics.median(together),
            "slowdown": max(1.0, statistics.median(ratios))}


def measured_workload(m: dict, n_params: int, batch: int, **kw) -> Workload:
    """The Workload of what :func:`measure_compute` measured (``m``: its figures that are
    :class:`~hpcps.strategies.cost.Workload` fields; ``compute_s`` and ``update_s_per_param``
    at least), with ``kw`` for the rest (``kw`` wins over ``m``)."""
    taken = {f.name for f in fields(Workload)} - {"n_params", "batch"} - set(kw)
    return Workload(n_params=n_params, batch=batch, compute_s=m["compute_s"],
                    update_s_per_param=m["update_s_per_param"],
                    **{k: v for k, v in m.items() if k in taken
                       and k not in ("compute_s", "update_s_per_param")}, **kw)


def in_run_workload(w: Workload, pass_s: float, cpu_time: bool = False) -> Workload:
    """``w`` with the gradient pass as a run timed it, every other CPU term slowed by the same
    factor over the calibrated pass. ``pass_s`` in wall seconds (the summary's ``pass_s``)
    already holds what the cores' sharing, co-running and the machine's speed of that minute
    did to the pass, so the shared-cores terms go. In CPU seconds (``cpu_time``, the
    summary's ``pass_cpu_s``) it holds co-running and the machine's speed but not the time
    the pass waited for a core: the sharing of the cores (:meth:`Workload.share`) stays."""
    f = pass_s / w.compute_s
    portion = w.portion_s_per_example
    shared = {"cores": w.cores, "background": w.background} if cpu_time else \
        {"cores": None, "background": 0.0}
    return replace(w, compute_s=pass_s, update_s_per_param=w.update_s_per_param * f,
                   reduce_s_per_param=w.reduce_s_per_param * f,
                   reckon_s_per_param=w.reckon_s_per_param * f,
                   receive_s_per_word=w.receive_s_per_word * f, reckon_compute_s=None,
                   average_s_per_param=w.average_s_per_param * f,
                   portion_s_per_example=None if portion is None else portion * f,
                   co_run=1.0, **shared)


