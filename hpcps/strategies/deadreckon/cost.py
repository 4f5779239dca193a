"""deadreckon's cost model (:mod:`hpcps.strategies.cost`). Every step a replica computes
(its pass, ``reckon_compute_s``), thresholds the residual and packs the message
(``reckon_s_per_param`` on the whole vector), sends one compressed message
(``HEADER + updates * bits / 8`` bytes, :mod:`hpcps.compress.codec`) to each of the R-1 peers,
and applies its own words and the peers' messages (``receive_s_per_word`` each; no optimizer
step: the words are the update). The updates per step and bits per update are inputs (they
depend on the data and tau: take them from a run's summary). Checked against Strom 2015,
Table 2 (:func:`strom_table2`). No MPI."""
from __future__ import annotations

from dataclasses import replace

from hpcps.compress.codec import HEADER_BYTES
from hpcps.strategies.cost import CostModel, Workload


def message_bytes(w: Workload) -> float:
    """One message: the codec's header, the packed updates, the sender's step."""
    return HEADER_BYTES + 8 + w.updates_per_step * w.bits_per_update / 8


class DeadreckonCost(CostModel):
    calibrate = "hpcps.strategies.deadreckon.calibrate:measure"

    def bytes_per_step(self, w: Workload, R: int) -> float:
        return message_bytes(w) * (R - 1)  # one message per step to each of R-1 peers

    def examples_per_s(self, w, nodes, alpha, beta, allreduce=None) -> float:
        n, b = w.n_params, w.batch
        share = w.share(nodes)  # CPU work on shared cores (1 on real nodes)
        R = nodes
        t = w.compute(nodes, w.reckon_compute_s)
        # no optimizer: its update is its own words, applied as a peer's message is
        per_word = w.receive_s_per_word or w.update_s_per_param
        t += n * w.reckon_s_per_param * share \
            + (R - 1) * (alpha + message_bytes(w) * beta) \
            + R * w.updates_per_step * per_word * share  # its own words, and theirs
        return R * b / t

    def from_run(self, w: Workload, run: dict) -> Workload:
        """The updates per step depend on the data: taken from the run's bytes."""
        if run["replicas"] <= 1:
            return w
        per_msg = run["bytes_per_step"] / (run["replicas"] - 1)
        return replace(w, updates_per_step=max(0.0, per_msg - message_bytes(w)) * 8
                       / w.bits_per_update)

    def published(self) -> dict:
        return {"title": "Strom 2015 Table 2 (14.6M weights, 10k frames/s per node, 69 KB per "
                         "update, 1 Gb/s assumed)", "rows": strom_table2()}


COST = DeadreckonCost()

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
        model = COST.examples_per_s(w, nodes, alpha, beta) / (batch / w.compute_s)
        rows.append({"nodes": nodes, "paper_speedup": paper, "model_speedup": round(model, 2),
                     "relative_difference": round(model / paper - 1, 3)})
    return rows
