"""A scaling model: examples/s and speed-up of each strategy on 1 to 128+ nodes of a network.

    python -m hpcps.scaling --model 784,2560,2560,2560,2560,8192 --network 10gbe
    python -m hpcps.scaling --model 784,512,512,10 --alpha 30e-6 --beta 8e-9 --png curves.png
    python -m hpcps.scaling --validate-cluster cluster.json     # against bench/cluster's runs

The model is the alpha-beta (Hockney) one: sending m bytes costs ``alpha + m * beta``
seconds; a node's link is full duplex (sending and receiving overlap), and a node computes or
communicates, never both at once (no overlap, as the strategies' loops run). Per strategy,
with R nodes training replicas, n parameters, a mini-batch of b examples taking ``t_c``
seconds to compute (measured on this CPU, :func:`measure_compute`) and ``t_u`` seconds per
parameter for the optimizer's update:

``sync``        every step: compute, then a ring allreduce of the n+1 floats:
                ``2 (R-1) alpha + 2 (R-1)/R * 4 (n+1) * beta``, then the update.
``averaging``   every step compute and update; every k steps (``--average-every``) a ring
                allreduce of the parameters and optimizer state, and the average's own
                copies in and out of its buffer (``average_s_per_param``, measured).
``downpour``    every step a replica computes, pushes its 4n-byte gradient and fetches 4n
                bytes of parameters from the S shards (the reply waits for the shard to
                apply the push ahead of it); a shard's loop, one request at a time, takes R
                pushes, applies them and serves R fetches per round of steps: the job runs
                at the slower of the replicas and the shards. S nodes are shards
                (``--servers``, default 1), so R = N - S.
``deadreckon``  every step compute, threshold the residual and send one compressed message
                (``HEADER + updates * bits / 8`` bytes, :mod:`hpcps.compress.codec`) to each of the
                R-1 peers; apply its own words and the peers' messages (no optimizer step:
                the words are the update). The updates per step and bits per update are
                inputs (they depend on the data and tau: take them from a run's summary).
``sandblaster`` one batch evaluation: the batch split over the replicas' portions; each
                replica fetches the parameters once and pushes its accumulated gradient
                every ``--flush-every`` portions it computed (and its remainder), through one
                shard; the coordinator's commands are small (alpha each). On shared cores
                only the replicas compete for them: the coordinator and the shard wait
                for messages without computing.

Work on the whole parameter vector is measured on this CPU too: the seconds per float an
allreduce sums (``reduce_s_per_param``; sync and averaging: a ring sums (R-1)/R of the vector
on each node; the alpha-beta model's missing per-byte arithmetic term), and the seconds per
parameter of deadreckon's step (``reckon_s_per_param``: scaling the gradient, adding it to
the residual, thresholding and packing the message with :class:`hpcps.compress.codec.Compressor`,
the code deadreckon runs), added to every deadreckon step, and what decoding and applying
a message costs per word (``receive_s_per_word``), for its own words and each peer's. Both,
and deadreckon's pass, are timed in steps taken as a deadreckon replica takes them: its
vectors evict the weights from the caches (a pass timed alone ran 1.1-1.3x faster).

Bytes per step are the figures the strategies report in their summaries (``sync.py``,
``averaging.py``, ``downpour.py``, ``deadreckon.py``; ``--validate-cluster`` prints both).
Model parallelism (P > 1) is not modelled.

Two checks, printed side by side with what they are checked against: ``--validate-cluster``
(the emulated cluster's measured examples/s, :file:`bench/cluster/bench_cluster.py`, with the
measured alpha and beta of its network and its ranks sharing this machine's cores), and
:func:`strom_table2` (Strom 2015, Table 2: speed-up against nodes for a 14.6M-weight DNN).
"""
from __future__ import annotations

import os

# one BLAS thread, as hpcps.train runs each rank (set before NumPy is first imported)
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import numpy as np  # noqa: E402

from hpcps.compress import codec as compress  # noqa: E402
from hpcps.mpi import protocol  # noqa: E402

# alpha (s), beta (s per byte): typical MPI figures for each network (latency of a small
# message; the link's line rate)
NETWORKS = {
    "1gbe": (50e-6, 8 / 1e9),
    "10gbe": (20e-6, 8 / 10e9),
    "25gbe": (10e-6, 8 / 25e9),
    "100gbe": (5e-6, 8 / 100e9),
    "ib-edr": (1.5e-6, 8 / 100e9),
    "ib-hdr": (1.2e-6, 8 / 200e9),
}

STRATEGIES = ("sync", "averaging", "downpour", "deadreckon", "sandblaster")
# every replica sends and receives at once in each step (a ring allreduce's steps, or
# deadreckon's message to every peer): checked with the latency and bandwidth of a ring
# exchange, not of one pair's ping-pong (bench/cluster/pingpong.py measures both)
RING_STRATEGIES = ("sync", "averaging", "deadreckon")


@dataclass(frozen=True)
class Workload:
    """What one step costs on one node, apart from the network.

    Parameters
    ----------
    n_params : parameters of the model.
    batch : examples per mini-batch per replica.
    compute_s : seconds for one mini-batch's forward and backward pass on a core of its own.
    update_s_per_param : seconds of the optimizer's update per parameter.
    state_vectors : optimizer state vectors (adagrad: 1), averaged with the parameters.
    average_every : averaging's k.
    updates_per_step : deadreckon: thresholded elements per message (a run's summary gives
        ``updates_per_step``; Strom's Table 3 gives update sizes).
    bits_per_update : deadreckon: bits per sent element (``bits_per_update`` in a summary).
    batch_examples : sandblaster: examples per L-BFGS iteration (the training set).
    portion_s_per_example : sandblaster: seconds per example of a portion's gradient (large
        batches run BLAS faster per example than mini-batches); default compute_s / batch.
    portions, flush_every : sandblaster's ``--portions`` and ``--flush-every``.
    servers : downpour: parameter-server shards S (nodes that do not train).
    reduce_s_per_param : seconds per float an allreduce sums (sync, averaging).
    reckon_s_per_param : deadreckon: seconds per parameter of its per-step work on the whole
        vector (scale the gradient, add it to the residual, threshold, pack).
    receive_s_per_word : deadreckon: seconds per thresholded element to decode and apply a
        message, its own words and each peer's (0: ``update_s_per_param``).
    average_s_per_param : averaging: seconds per parameter of an average's own work on its
        vectors (the parameters and the state copied into the buffer, the mean, the
        spread, copied back), with ``state_vectors`` state vectors.
    reckon_compute_s : deadreckon: its pass, which runs slower than ``compute_s`` because
        the step's vectors (residual, counts, reference weights) push the weights out of
        the caches between passes; None: ``compute_s``.
    cores : cores shared by all nodes (the emulated cluster: every node is a namespace of one
        machine); None for real nodes, each with its own CPU.
    background : runnable threads of other jobs on those cores while the nodes run (a
        shared machine's load).
    co_run : how much slower a pass runs on those cores when all of them compute at once
        than on one alone (:func:`measure_together`; 1 for real nodes); measured with more
        processes than cores, it also holds what taking turns on a core does to a pass (its
        caches refilled after every switch), which :meth:`share`'s time slices do not.
    """

    n_params: int
    batch: int
    compute_s: float
    update_s_per_param: float = 1e-9
    state_vectors: int = 1
    average_every: int = 4
    updates_per_step: float = 0.0
    bits_per_update: float = 11.0
    batch_examples: int = 60000
    portion_s_per_example: float | None = None
    portions: int = 64
    flush_every: int = 4
    servers: int = 1
    reduce_s_per_param: float = 0.0
    reckon_s_per_param: float = 0.0
    receive_s_per_word: float = 0.0
    average_s_per_param: float = 0.0
    reckon_compute_s: float | None = None
    cores: int | None = None
    background: float = 0.0
    co_run: float = 1.0

    def share(self, nodes: int) -> float:
        """How many times longer CPU work takes when ``nodes`` ranks run than on a core of
        its own: 1 on real nodes; on shared cores each of the runnable threads (ours and
        the background's) gets cores / threads of a core, at ``co_run`` times the time once
        every core is busy (in proportion before)."""
        if not self.cores:
            return 1.0
        busy = min(float(self.cores), nodes + self.background)
        co_run = 1.0 if self.cores < 2 else \
            1.0 + (self.co_run - 1.0) * max(0.0, busy - 1.0) / (self.cores - 1.0)
        return co_run * max(1.0, (nodes + self.background) / self.cores)

    def compute(self, nodes: int, strategy: str | None = None) -> float:
        """Seconds of one mini-batch when ``nodes`` ranks compute at once (:meth:`share`),
        in a ``strategy``'s step (deadreckon's: ``reckon_compute_s``)."""
        own = self.reckon_compute_s if strategy == "deadreckon" else None
        return (own or self.compute_s) * self.share(nodes)


def ring(nbytes: float, R: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Seconds of a ring allreduce of ``nbytes`` (float32) over R nodes; ``gamma``: seconds per
    float summed (each node sums (R-1)/R of the vector)."""
    if R <= 1:
        return 0.0
    return 2 * (R - 1) * alpha + (R - 1) / R * nbytes * (2 * beta + gamma / 4)


def bytes_per_step(strategy: str, w: Workload, R: int) -> float:
    """Bytes moved per step, as the strategy's summary counts them (per replica step)."""
    n = w.n_params
    if strategy == "sync":  # sync.py: 2 * buf.nbytes * (R-1)/R, buf = n + 1 floats
        return 2 * 4 * (n + 1) * (R - 1) / R
    if strategy == "averaging":  # averaging.py: the same per average, every k steps
        return 2 * 4 * n * (1 + w.state_vectors) * (R - 1) / R / w.average_every
    if strategy == "downpour":  # ps/client.py: per shard a push, an ask and a reply
        return 2 * 4 * n + 3 * protocol.HEADER_BYTES * w.servers
    if strategy == "deadreckon":  # deadreckon.py: one message per step to each of R-1 peers
        return message_bytes(w) * (R - 1)
    if strategy == "sandblaster":  # per batch evaluation: each replica's fetch and pushes
        return 4 * n * sandblaster_transfers(w, R)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


def sandblaster_transfers(w: Workload, R: int) -> int:
    """Parameter vectors a batch evaluation moves: a fetch per replica, and per replica a push
    of every ``flush_every`` portions of its share (about portions / R; the last push may be
    short)."""
    return R + R * -(-w.portions // (R * w.flush_every))


def message_bytes(w: Workload) -> float:
    """One deadreckon message: compress's header, the packed updates, the sender's step."""
    return compress.HEADER_BYTES + 8 + w.updates_per_step * w.bits_per_update / 8


def predict(strategy: str, w: Workload, nodes: int, alpha: float, beta: float,
            allreduce=None) -> float:
    """Examples per second of ``strategy`` on ``nodes`` nodes (0.0 where it cannot run).
    ``allreduce(nbytes, R)``: seconds of MPI's allreduce as measured on the network (its sum
    included), in place of the ring formula, for sync and averaging."""
    n, b = w.n_params, w.batch
    share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
    if strategy in ("sync", "averaging", "deadreckon"):
        R = nodes
        t = w.compute(nodes, strategy)
        gamma = w.reduce_s_per_param * share

        def reduce(nbytes: float) -> float:
            if allreduce is None or R <= 1:
                return ring(nbytes, R, alpha, beta, gamma)
            return allreduce(nbytes, R)
        if strategy == "sync":
            t += n * w.update_s_per_param * share + reduce(4 * (n + 1))
        elif strategy == "averaging":
            average = reduce(4 * n * (1 + w.state_vectors)) \
                + (n * w.average_s_per_param * share if R > 1 else 0.0)  # one: no average
            t += n * w.update_s_per_param * share + average / w.average_every
        else:  # no optimizer: its update is its own words, applied as a peer's message is
            per_word = w.receive_s_per_word or w.update_s_per_param
            t += n * w.reckon_s_per_param * share \
                + (R - 1) * (alpha + message_bytes(w) * beta) \
                + R * w.updates_per_step * per_word * share  # its own words, and theirs
        return R * b / t
    if strategy == "downpour":
        S = w.servers
        R = nodes - S
        if R < 1:
            return 0.0
        # a replica talks to every shard: a push, an ask and a reply of n/S parameters each;
        # the reply waits for the shard to apply the push ahead of the ask
        replica = w.compute(nodes) + 3 * S * alpha + 2 * 4 * n * beta \
            + n / S * w.update_s_per_param * share
        # a shard's loop does one thing at a time (ps/gradient_shard.py): per replica step it
        # receives the push, applies it, answers the ask with its n/S parameters
        shard = R * (3 * alpha + 2 * 4 * n / S * beta + n / S * w.update_s_per_param * share)
        return R * b / max(replica, shard)
    if strategy == "sandblaster":
        R = nodes - 2
        if R < 1:
            return 0.0
        per_example = w.portion_s_per_example or w.compute_s / b
        # on shared cores only the replicas compete: the coordinator and the shard wait
        # for messages without computing (their loops sleep between polls)
        share = w.share(R)
        work = share * per_example * w.batch_examples / R
        shard = sandblaster_transfers(w, R) * (alpha + 4 * n * beta)  # fetches, pushes: one link
        commands = 20 * alpha * 2  # the coordinator's L-BFGS commands, round trips
        return w.batch_examples / (work + shard + commands
                                   + 4 * n * w.update_s_per_param * share)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")


def curve(strategy: str, w: Workload, nodes: list[int], alpha: float, beta: float) -> list:
    """(nodes, examples/s, speed-up over one node computing alone) for each node count."""
    single = w.batch / (replace(w, cores=None).compute(1) + w.n_params * w.update_s_per_param)
    out = []
    for k in nodes:
        eps = predict(strategy, w, k, alpha, beta)
        out.append((k, eps, eps / single))
    return out


def sample_inputs(layers: list[int], rows: int, data: str | None = None):
    """``rows`` examples to time with, and what they are: the first rows of ``data``'s
    training split (an hpcps HDF5 dataset) when given, else dense standard-normal inputs
    (no zeros: the slowest case for the first layer, which skips zero inputs)."""
    if data:
        from hpcps.io.data.h5format import load_split, open_dataset
        info = open_dataset(data)
        if info.n_features != layers[0]:
            raise ValueError(f"{data}: rows of {info.n_features} features, but the model's "
                             f"first layer takes {layers[0]}")
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


def measure_compute(layers: list[int], batch: int, repeats: int = 15,
                    portion: int = 512, data: str | None = None, start=None,
                    pass_only: bool = False) -> dict:
    """One mini-batch's forward and backward pass and an Adagrad update, on this CPU, one
    thread, medians of ``repeats`` steps taken as a replica takes them (pass, update; after
    ``WARM_STEPS``), and the work on the whole vector that an allreduce
    (``reduce_s_per_param``) and a deadreckon step (``reckon_s_per_param``: scale, residual,
    threshold at a tau that sends about one element in 1,000, pack) add per parameter:
    ``compute_s`` and the ``*_per_param`` figures in CPU seconds
    (what the work costs a core of its own, also on a loaded machine), ``compute_wall_s`` in
    wall seconds (what it took here, sharing the cores), and the load average then.

    The pass runs the code a replica runs (:class:`hpcps.strategies.gradients.GradientSource`
    at one thread): the compiled engine's ``loss_and_grad`` when it is built (its first layer
    skips zero inputs, its sgemm is the BLAS ``HPCPS_BLAS`` chooses), NumPy's otherwise, each
    repeat on the next mini-batch of :func:`sample_inputs` (``data``: the user's rows, whose
    zeros the first layer skips). Sandblaster's portion (``portion_s_per_example``) is
    ``portion`` rows summed as its replicas sum them (``gradient_sum`` in chunks of 256).
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
        from hpcps.strategies.sandblaster.common import PORTION_CHUNK
        engine = hogwild.HogwildEngine(layers, "relu", threads=1, batch=batch)
        chunks = hogwild.HogwildEngine(layers, "relu", threads=1, batch=PORTION_CHUNK)
        step = engine.loss_and_grad
        skip = engine.zero_skip_isa
        skipping = f"first layer skips zeros, {skip}" if skip else "no zero skipping"
        path = f"compiled engine ({skipping}; sgemm: {blas.current()})"
    else:
        step, chunks = model.loss_and_grad, None
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
    rows = np.arange(portion, dtype=np.int64)
    if chunks is not None:
        chunks.gradient_sum(params, x, y, rows[:PORTION_CHUNK], grad)  # warm
        c = time.process_time()
        chunks.gradient_sum(params, x, y, rows, grad)
    else:
        c = time.process_time()
        model.loss_and_grad(params, x[:portion], y[:portion], grad)
    portion_s = (time.process_time() - c) / portion
    n = model.n_params
    other = rng_normal(n, 1)
    red = []
    for _ in range(repeats):
        c = time.process_time()
        np.add(grad, other, out=grad)
        red.append(time.process_time() - c)
    reckon = measure_reckon(step, model, params, x, y, batch, repeats)
    from hpcps.strategies.averaging.replica import pack, to_mean, unpack
    mine, own_state = params.copy(), {k: v.copy() for k, v in state.items()}
    keys = list(own_state)  # Adagrad's one vector, as averaging's default averages it
    buf = np.empty((1 + len(keys)) * n + 1, np.float32)
    average = []
    for _ in range(repeats):
        c = time.process_time()
        pack(buf, mine, own_state, keys)
        to_mean(buf, mine, 2)
        unpack(buf, mine, own_state, keys)
        average.append(time.process_time() - c)
    return {"compute_s": statistics.median(cpu),
            "compute_wall_s": statistics.median(wall),
            "update_s_per_param": statistics.median(upd) / model.n_params,
            "reduce_s_per_param": statistics.median(red) / n,
            "portion_s_per_example": portion_s,
            "average_s_per_param": statistics.median(average) / n,
            **reckon,
            "path": f"{path}, on {inputs}",
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0}


RECKON_DENSITY = 0.002  # deadreckon's messages: about 2 words per 1,000 parameters
PEER_MESSAGES = 8  # distinct peer messages cycled through (other words each step)


def measure_reckon(step, model, params, x, y, batch: int, repeats: int) -> dict:
    """Steps taken as a deadreckon replica takes them (:mod:`hpcps.strategies.deadreckon`),
    in CPU seconds, medians of ``repeats`` after ``WARM_STEPS``: the pass (``step`` on the
    next mini-batch; ``reckon_compute_s``), the step scaled and thresholded into the
    residual and packed (``reckon_s_per_param``), then its own words and one peer's message
    (decoded) applied to the replica's copy (``receive_s_per_word``). Tau sends about
    ``RECKON_DENSITY`` of the elements, as the adaptive tau does."""
    from hpcps.strategies.deadreckon.replica import Reckoner
    n = model.n_params
    reckoner = Reckoner(params.copy(), 1e-7)
    peers = []
    for k in range(PEER_MESSAGES):
        v = rng_normal(n, 10 + k)
        c = compress.Compressor(n, float(np.quantile(np.abs(v), 1.0 - RECKON_DENSITY)))
        msg, words = c.compress(v)
        peers.append((msg.copy(), len(words)))
    grad = np.empty(n, np.float32)
    comp, scale = None, np.float32(-0.01)
    passes, work, per_word = [], [], []
    for i in range(WARM_STEPS + repeats):
        j = i % (len(x) // batch)
        c = time.process_time()
        step(reckoner.params, x[j * batch:(j + 1) * batch], y[j * batch:(j + 1) * batch],
             grad=grad)
        passes.append(time.process_time() - c)
        if comp is None:
            tau = float(np.quantile(np.abs(grad * scale), 1.0 - RECKON_DENSITY))
            comp = compress.Compressor(n, max(tau, 1e-12))
        comp.residual[:] = 0.0  # each step sends about RECKON_DENSITY of the elements
        c = time.process_time()
        grad *= scale
        _, words = comp.compress(grad)
        work.append(time.process_time() - c)
        msg, k = peers[i % PEER_MESSAGES]
        c = time.process_time()
        reckoner.apply(words, 1)
        reckoner.apply(compress.decode(msg, n), 1)
        per_word.append((time.process_time() - c) / max(1, len(words) + k))
    return {"reckon_compute_s": statistics.median(passes[WARM_STEPS:]),
            "reckon_s_per_param": statistics.median(work[WARM_STEPS:]) / n,
            "receive_s_per_word": statistics.median(per_word[WARM_STEPS:])}


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


def rng_normal(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def measured_workload(m: dict, n_params: int, batch: int, **kw) -> Workload:
    """The Workload of what :func:`measure_compute` measured (``m``), with ``kw`` for the
    rest."""
    return Workload(n_params=n_params, batch=batch, compute_s=m["compute_s"],
                    update_s_per_param=m["update_s_per_param"],
                    reduce_s_per_param=m["reduce_s_per_param"],
                    reckon_s_per_param=m["reckon_s_per_param"],
                    portion_s_per_example=m["portion_s_per_example"],
                    receive_s_per_word=m.get("receive_s_per_word", 0.0),
                    average_s_per_param=m.get("average_s_per_param", 0.0),
                    reckon_compute_s=m.get("reckon_compute_s"), **kw)


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


# -- the checks --------------------------------------------------------------------------------
# Strom 2015, Table 2: nodes, relative speed (epochs 2-10, tau = 4).
STROM_TABLE2 = [(1, 1.0), (5, 4.3), (10, 8.7), (20, 17.0), (40, 33.0), (80, 54.0)]


def strom_table2(gbit: float = 1.0) -> list[dict]:
    """The model fed Strom's sizes: 14.6M weights, 10,000 frames/s on one node, mini-batches
    of 1024 frames (Table 1), 69 KB per update message at tau = 4 (Table 3); a network of
    ``gbit`` Gb/s (AWS EC2 G2 instances; the paper does not give the rate). Each row: nodes,
    the paper's speed-up, the model's, the relative difference."""
    n, batch = 14_600_000, 1024
    w = Workload(n_params=n, batch=batch, compute_s=batch / 10_000.0, update_s_per_param=0.0,
                 updates_per_step=69_000 * 8 / 11.0, bits_per_update=11.0)
    alpha, beta = 50e-6, 8 / (gbit * 1e9)
    rows = []
    for nodes, paper in STROM_TABLE2:
        model = predict("deadreckon", w, nodes, alpha, beta) / (batch / w.compute_s)
        rows.append({"nodes": nodes, "paper_speedup": paper, "model_speedup": round(model, 2),
                     "relative_difference": round(model / paper - 1, 3)})
    return rows


def pair_link(net: dict, computing: float) -> tuple[float, float]:
    """alpha and beta of one pair's link (a replica and a shard) on a bench's network
    ``net`` while ``computing`` other ranks compute on the cores the pair shares: TCP's
    copies and the receiver's turn to run wait for the cores. Interpolated between the
    bench's ping-pongs, each measured with its ranks less the pair computing (``pingpong``:
    none; ``pingpong_at``: one per rank count of the runs)."""
    points = sorted([(0.0, net["pingpong"]["alpha_s"], net["pingpong"]["beta_s_per_byte"])]
                    + [(int(k) - 2.0, pp["alpha_s"], pp["beta_s_per_byte"])
                       for k, pp in net.get("pingpong_at", {}).items()])
    at, alphas, betas = zip(*points)
    return float(np.interp(computing, at, alphas)), float(np.interp(computing, at, betas))


def measured_allreduce(record: dict):
    """``allreduce(nbytes, R)`` from a bench's measured Iallreduce times (``allreduce`` in a
    ping-pong record: seconds per call at several sizes, with the record's ranks): straight
    lines between the measured sizes, in proportion to the size beyond the largest."""
    sizes = np.asarray(record["bytes"], float)
    secs = np.asarray(record["seconds"], float)

    def allreduce(nbytes: float, R: int) -> float:
        if nbytes > sizes[-1]:
            return float(secs[-1] * nbytes / sizes[-1])
        return float(np.interp(nbytes, sizes, secs))
    return allreduce


def computing_beside(strategy: str, w: Workload, nodes: int, link) -> float:
    """How many ranks compute, on average, while a replica and its shard move a message
    (``downpour``, ``sandblaster``); ``link(computing)`` gives that link's (alpha, beta).
    Sandblaster: the other R - 1 replicas, computing their portions (the coordinator and the
    shard wait without computing). Downpour: the other R - 1 replicas for the part of their
    step they compute, which depends on how fast the shard's link runs: the fixed point,
    found by bisection (more computing slows the link, which lengthens the step and so
    shortens the part spent computing)."""
    if strategy == "sandblaster":
        return float(max(0, nodes - 3))
    R = nodes - w.servers
    lo, hi = 0.0, float(max(0, R - 1))
    for _ in range(40):
        mid = (lo + hi) / 2
        eps = predict(strategy, w, nodes, *link(mid))
        step = R * w.batch / eps if eps > 0 else float("inf")
        if (R - 1) * min(1.0, w.compute(nodes) / step) > mid:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def validate_cluster(path: str, repeats: int = 15, background: float | None = None,
                     data: str | None = None) -> list:
    """The model against bench/cluster's measured throughput: for each run, the examples/s
    predicted with that network's measured alpha and beta (measured with as many ranks
    running as the run had, ``pingpong_at``, where the bench recorded it: on shared cores a
    message waits for its receiver to be scheduled; for sync, averaging and deadreckon those
    of a ring exchange, every rank sending at once, ``ring``, where recorded, and for sync
    and averaging MPI's own allreduce timed at several sizes, ``allreduce``, where recorded
    (:func:`measured_allreduce`); for downpour and sandblaster one pair's link with as
    many other ranks computing as the run had beside it, :func:`pair_link` and
    :func:`computing_beside`), this machine's cores shared by the computing ranks (all but
    sandblaster's coordinator and shard) and by ``background`` runnable threads of other
    jobs (default: the load
    average the bench recorded, else the current one, less the measuring process), each
    pass slower by what :func:`measure_together` measures with every core computing (with
    as many processes as the run's computing ranks, where the bench's calibration says so:
    ``co_run_processes``), and
    (deadreckon) the run's own message size (bytes per step / (R - 1)); against the run's
    steady examples/s where recorded (the model has no start or end). The compute is
    what the bench measured just before each run (``compute`` in its record: a shared
    machine's speed drifts over minutes); for a bench that did not, it is measured here, on
    rows of ``data`` (default: the bench's dataset, where that file is here), whose zeros
    the first layer skips as it did in the runs. Where a run recorded its replicas' own
    pass time, each row also has ``predicted_in_run``: the model with that pass
    (:func:`in_run_workload`), which leaves out what co-running and the machine's drift
    during the run did to the CPU work and checks the rest: the pass's CPU time
    (``pass_cpu_s`` in the summary) for every run, the cores' sharing left to the model;
    for a bench that recorded only its wall time (``pass_s``), runs with no more ranks
    than cores."""
    with open(path) as fh:
        bench = json.load(fh)
    layers = [int(v) for v in str(bench["layers"]).split(",")]
    batch = int(bench.get("batch", 32))  # bench_cluster's BATCH (recorded since it was 32)
    if data is None and bench.get("data") and os.path.exists(bench["data"]):
        data = bench["data"]
    n = sum((layers[i] + 1) * layers[i + 1] for i in range(len(layers) - 1))
    cores = bench.get("machine", {}).get("nproc") or os.cpu_count()
    if background is None:
        load = bench.get("machine", {}).get("load_average")
        background = max(0.0, (os.getloadavg()[0] if load is None else load) - 1)
    runs = [r for net in bench["networks"] for r in net.get("throughput", [])
            if "error" not in r]
    here = None  # measured now, for runs the bench did not calibrate
    if not all("compute" in r for r in runs):
        here = measure_compute(layers, batch, repeats, data=data)
        here["co_run"] = measure_together(layers, batch, min(cores, os.cpu_count() or 1),
                                          data=data)["slowdown"]
    rows = []
    for net in bench["networks"]:
        for run in net.get("throughput", []):
            if "error" in run:
                continue
            c = run.get("compute", here)  # the bench's calibration just before the run
            shared = measured_workload(c, n, batch, cores=cores, background=background,
                                       co_run=c.get("co_run", 1.0))
            w = replace(shared, servers=max(1, run.get("servers", 1)))
            pp = net.get("pingpong_at", {}).get(str(run["ranks"]), net["pingpong"])
            computing = None  # downpour, sandblaster: ranks computing beside the pair's link
            allreduce = None  # MPI's allreduce as measured with the run's ranks, if it was
            if run["strategy"] in ("sync", "averaging") and "allreduce" in pp \
                    and pp.get("ranks", 2) == run["ranks"]:
                allreduce = measured_allreduce(pp["allreduce"])
            if run["strategy"] in RING_STRATEGIES and "ring" in pp:
                pp = pp["ring"]  # every rank sends at once, as these strategies' steps do
            elif run["strategy"] in ("downpour", "sandblaster"):
                # one pair's link, with as many other ranks computing as the run had
                computing = computing_beside(run["strategy"], w, run["ranks"],
                                             lambda c: pair_link(net, c))
                pp = dict(zip(("alpha_s", "beta_s_per_byte"), pair_link(net, computing)))
            if run["strategy"] == "deadreckon" and run["replicas"] > 1:
                # the updates per step depend on the data: take them from the run's bytes
                per_msg = run["bytes_per_step"] / (run["replicas"] - 1)
                w = replace(w, updates_per_step=max(0.0, per_msg - message_bytes(w)) * 8
                            / w.bits_per_update)
            link = (run["ranks"], pp["alpha_s"], pp["beta_s_per_byte"])
            pred = predict(run["strategy"], w, *link, allreduce=allreduce)
            # the steady rate (without the run's start and end), where the bench took it
            measured = run.get("steady_examples_per_s") or run["examples_per_s"]
            row = {"network": net["rate"], "strategy": run["strategy"],
                   "ranks": run["ranks"], "measured": measured,
                   "predicted": round(pred, 1), "alpha_s": pp["alpha_s"],
                   "relative_difference": round(pred / measured - 1, 3),
                   "background": round(background, 1),
                   "co_run": round(w.co_run, 3),
                   "compute_s": w.compute_s,
                   "bytes_measured": run["bytes_per_step"],
                   "bytes_model": round(bytes_per_step(run["strategy"], w, run["replicas"]))}
            if computing is not None:
                row["computing_beside"] = computing
            # the replicas' pass as the run itself timed it: its CPU time where recorded
            # (the cores' sharing is then the model's), else its wall time where no rank
            # was time-sliced (with more ranks than cores the wall time of a pass of a few
            # ms holds only part of the sharing the rest of the step takes)
            cpu_time = bool(run.get("pass_cpu_s"))
            own = None
            if cpu_time:
                own = in_run_workload(w, run["pass_cpu_s"], cpu_time=True)
            elif run.get("pass_s") and run["ranks"] <= cores:
                own = in_run_workload(w, run["pass_s"])
            if own is not None:
                pred_run = predict(run["strategy"], own, *link, allreduce=allreduce)
                row.update(pass_s_in_run=own.compute_s, pass_in_run_is_cpu_time=cpu_time,
                           predicted_in_run=round(pred_run, 1),
                           relative_difference_in_run=round(pred_run / measured - 1, 3))
            rows.append(row)
    return rows


def plot(curves: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        pts = [p for p in pts if p[1] > 0]  # node counts the strategy cannot run on
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ms=3, label=name)
    top = max(p[0] for pts in curves.values() for p in pts)
    ax.plot([1, top], [1, top], color="grey", lw=0.8, ls="--", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("speed-up over one node")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcps.scaling",
                                description="Predict examples/s and speed-up per strategy "
                                            "for 1..N nodes (alpha-beta model).")
    p.add_argument("--model", default="784,512,512,10", help="layer widths")
    p.add_argument("--network", default="10gbe", choices=sorted(NETWORKS))
    p.add_argument("--alpha", type=float, help="latency, seconds (instead of --network)")
    p.add_argument("--beta", type=float, help="seconds per byte (instead of --network)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--servers", type=int, default=1, help="downpour: shard nodes S")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--compression", type=float, default=1000.0,
                   help="deadreckon: dense gradient bytes / message bytes (Strom: ~850 at "
                        "tau 4; a run's summary gives compression_ratio)")
    p.add_argument("--png", default="scaling.png", help="where the plot goes ('' for none)")
    p.add_argument("--validate-cluster", metavar="JSON",
                   help="bench/cluster/bench_cluster.py output to check the model against")
    p.add_argument("--background-load", type=float,
                   help="--validate-cluster: runnable threads of other jobs on the machine "
                        "while the bench ran (default: its recorded load average, else now's)")
    p.add_argument("--data", metavar="H5",
                   help="time the mini-batches on rows of this dataset (hpcps HDF5; the "
                        "first layer skips their zeros) instead of dense random inputs")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def _positive_ints(text: str, what: str, parser) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{what} takes comma-separated whole numbers, got {text!r}")
    if any(v < 1 for v in values):
        parser.error(f"{what} must be at least 1, got {text!r}")
    return values


def _bench_json(path: str, parser) -> None:
    """Refuse a --validate-cluster file that bench_cluster.py did not write, before any
    measuring."""
    try:
        with open(path) as fh:
            bench = json.load(fh)
        if not isinstance(bench, dict) or bench.get("bench") != "cluster" \
                or not isinstance(bench.get("networks"), list) or "layers" not in bench:
            raise ValueError("no 'bench': 'cluster' record with 'layers' and 'networks'")
    except (OSError, ValueError) as exc:
        parser.error(f"--validate-cluster {path}: not the JSON of "
                     f"bench/cluster/bench_cluster.py ({exc})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.alpha is None) != (args.beta is None):
        parser.error("give both --alpha and --beta, or neither (then --network)")
    if args.alpha is not None and not (args.alpha >= 0 and args.beta > 0):
        parser.error(f"--alpha must be >= 0 and --beta > 0 seconds, got {args.alpha:g} and "
                     f"{args.beta:g}")
    alpha, beta = (args.alpha, args.beta) if args.alpha is not None else NETWORKS[args.network]
    net = (f"alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/byte "
           f"({8 / beta / 1e9:.1f} Gb/s)")
    layers = _positive_ints(args.model, "--model (layer widths)", parser)
    if len(layers) < 2:
        parser.error(f"--model needs at least two layer widths (inputs, classes), got "
                     f"{args.model!r}")
    nodes = _positive_ints(args.nodes, "--nodes", parser)
    if args.batch_size < 1 or args.servers < 1:
        parser.error(f"--batch-size and --servers must be at least 1, got {args.batch_size} "
                     f"and {args.servers}")
    if not args.compression > 0:
        parser.error(f"--compression must be > 0, got {args.compression:g}")
    unknown = sorted(set(args.strategies.split(",")) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(STRATEGIES)}")
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    if args.validate_cluster:
        _bench_json(args.validate_cluster, parser)
    m = measure_compute(layers, args.batch_size, data=args.data)
    t_c, t_u = m["compute_s"], m["update_s_per_param"]
    n = sum((layers[i] + 1) * layers[i + 1] for i in range(len(layers) - 1))
    bits = 11.0
    w = measured_workload(m, n, args.batch_size, servers=args.servers, bits_per_update=bits,
                          updates_per_step=4 * n / args.compression * 8 / bits)
    names = args.strategies.split(",")
    curves = {s: curve(s, w, nodes, alpha, beta) for s in names}
    out = {"model": layers, "parameters": n, "network": args.network if args.alpha is None
           else "custom", "alpha_s": alpha, "beta_s_per_byte": beta,
           "compute_s_per_batch": t_c, "update_s_per_param": t_u,
           "compute_wall_s_per_batch": m["compute_wall_s"], "load_average": m["load_average"],
           "compute_measured": m["path"],
           "curves": {s: [{"nodes": k, "examples_per_s": round(e, 1), "speedup": round(x, 2)}
                          for k, e, x in pts] for s, pts in curves.items()},
           "strom_table2": strom_table2()}
    if args.validate_cluster:
        out["cluster"] = validate_cluster(args.validate_cluster,
                                          background=args.background_load, data=args.data)
    if args.png:
        plot(curves, f"{args.model} ({n / 1e6:.1f}M parameters), batch {args.batch_size}\n"
                     f"{out['network']}: {net}", args.png)
        out["png"] = args.png
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"model {args.model}: {n:,} parameters; network {out['network']}: {net}")
    print(f"measured on this CPU: {t_c * 1e3:.2f} ms of CPU time per mini-batch of "
          f"{args.batch_size} (forward + backward; {m['compute_wall_s'] * 1e3:.2f} ms wall at "
          f"load average {m['load_average']:.1f}), {t_u * 1e9:.2f} ns per parameter per update"
          f"\n  ({m['path']})")
    print(f"\npredicted examples/s (speed-up over one node) per strategy; deadreckon at "
          f"compression {args.compression:g}")
    print("nodes  " + "".join(f"{s:>22}" for s in names))
    for i, k in enumerate(nodes):
        cells = []
        for s in names:
            _, e, x = curves[s][i]
            cells.append(f"{e:>12,.0f} ({x:6.1f}x)" if e > 0 else f"{'-':>22}")
        print(f"{k:>5}  " + "".join(cells))
    print("\ncheck 1, Strom 2015 Table 2 (14.6M weights, 10k frames/s per node, 69 KB per "
          "update, 1 Gb/s assumed):")
    print(f"  {'nodes':>5} {'paper':>8} {'model':>8} {'diff':>7}")
    for r in out["strom_table2"]:
        print(f"  {r['nodes']:>5} {r['paper_speedup']:>8.1f} {r['model_speedup']:>8.1f} "
              f"{100 * r['relative_difference']:>6.1f}%")
    print("\ncheck 2, the emulated cluster (bench/cluster, measured alpha and beta, ranks "
          "sharing this machine's cores): " + ("" if args.validate_cluster else
                                              "give --validate-cluster JSON"))
    if args.validate_cluster:
        if out["cluster"]:
            print(f"  (cores shared with {out['cluster'][0]['background']} runnable threads of "
                  "other jobs; pass: a mini-batch's forward and backward on a core alone, "
                  "co-run: how much slower with every core computing, by as many processes "
                  "as the run had computing where the bench measured so)")
            cpu = any(r.get("pass_in_run_is_cpu_time") for r in out["cluster"])
            print("  in run: the same model with the pass as each run timed it, every other "
                  "CPU term slowed as much: " + (
                      "its CPU time (the summary's pass_cpu_s; the cores' sharing is the "
                      "model's)" if cpu else "its wall time (the summary's pass_s), runs "
                      "with no more ranks than cores"))
        print(f"  {'network':>8} {'strategy':>12} {'ranks':>5} {'alpha':>9} {'pass':>8} "
              f"{'co-run':>6} {'measured':>10} "
              f"{'predicted':>10} {'diff':>7} {'in run: pass':>15} {'predicted':>10} "
              f"{'diff':>7} {'bytes/step':>12} {'model':>12}")
        for r in out["cluster"]:
            in_run = (f"{1e3 * r['pass_s_in_run']:>12.2f} ms {r['predicted_in_run']:>10,.0f} "
                      f"{100 * r['relative_difference_in_run']:>6.1f}%"
                      if "pass_s_in_run" in r else f"{'-':>15} {'-':>10} {'-':>7}")
            print(f"  {r['network']:>8} {r['strategy']:>12} {r['ranks']:>5} "
                  f"{1e6 * r['alpha_s']:>6,.0f} us {1e3 * r['compute_s']:>5.2f} ms "
                  f"{r['co_run']:>6.2f} {r['measured']:>10,.0f} "
                  f"{r['predicted']:>10,.0f} {100 * r['relative_difference']:>6.1f}% "
                  f"{in_run} {r['bytes_measured']:>12,.0f} {r['bytes_model']:>12,}")
        within = sum(abs(r["relative_difference"]) <= 0.25 for r in out["cluster"])
        print(f"  within 25%: {within} of {len(out['cluster'])} runs")
        timed = [r for r in out["cluster"] if "relative_difference_in_run" in r]
        if timed:
            within = sum(abs(r["relative_difference_in_run"]) <= 0.25 for r in timed)
            print(f"  within 25% with each run's own pass time: {within} of {len(timed)} runs "
                  "that timed it")
    if args.png:
        print(f"\nplot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
