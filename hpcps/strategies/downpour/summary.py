"""Downpour's summary: every replica's traffic and every shard's staleness, added up, and its
lines on the terminal. Pure: reads the ranks' results."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hpcps.strategies.rows_summary import row_figures, row_lines

if TYPE_CHECKING:
    from hpcps.strategies.context import Context


def summarize(ctx: Context, results: list[dict]) -> dict:
    """Traffic of every replica and staleness seen by every shard, added up."""
    cfg = ctx.cfg
    reps = [r for r in results if "replica_steps" in r]
    shards = [r for r in results if "shard" in r]
    trained = max(1, results[ctx.reporter].get("step", ctx.start_step) - ctx.start_step)
    moved = sum(r["bytes_sent"] + r["bytes_received"] for r in reps)
    out = {"bytes_per_step": moved / trained,
           "mean_staleness": sum(s["mean_staleness"] for s in shards) / max(1, len(shards)),
           "max_staleness": max((s["max_staleness"] for s in shards), default=0.0),
           # pushes by staleness as the first shard that reported saw them: bins 0, 1, 2-3,
           # 4-7, ..., >= 256 (shard 0 unless it was lost)
           "staleness_hist": min(shards, key=lambda s: s["shard"])["staleness_hist"]}
    out.update(results[ctx.reporter].get("figures", {}))  # the chief's model-parallel figures
    if shards and "rows_held" in shards[0]:  # an embedding model's rows on the shards
        out.update(row_figures(cfg, shards, reps, trained))
    if cfg.staleness_bound is not None:  # per shard, averaged over the shards
        out.update(staleness_bound=cfg.staleness_bound,
                   clock_lead_max=max(r["clock_lead_max"] for r in reps + shards),
                   ssp_held_fetches=sum(s["held_fetches"] for s in shards) / len(shards),
                   ssp_held_s=sum(s["held_s"] for s in shards) / len(shards))
    if shards and isinstance(shards[0].get("combined_updates"), int):
        from hpcps.strategies.downpour import softsync_group  # the package imports this module
        updates = sum(s["combined_updates"] for s in shards)
        out.update(softsync=softsync_group(cfg, ctx.grid.layout.replicas),
                   staleness_lr=cfg.staleness_lr or "off",
                   pushes_per_update=sum(s["combined_pushes"] for s in shards) / max(1, updates))
    if cfg.epoch_quorum is not None:
        keeper = next(s["epochs"] for s in shards if s["shard"] == 0)
        out.update(epoch_quorum=cfg.epoch_quorum, **keeper,
                   epoch_left_steps=sum(r["epoch_left"] for r in reps),
                   epoch_wait_s=max((r["epoch_wait_s"] for r in reps), default=0.0))
    if cfg.persist_every is not None:
        kept = [s["persist"] for s in shards]
        out.update(persist_every_s=cfg.persist_every,
                   persist_flushes=sum(k["flushes"] for k in kept),
                   persist_skipped_rounds=sum(k["skipped_rounds"] for k in kept),
                   persist_bytes=sum(k["bytes_written"] for k in kept),
                   persist_write_s=max(k["write_s"] for k in kept),
                   persist_copy_s=max(k["copy_s"] for k in kept),
                   persist_max_window_steps=max(k["max_window_steps"] for k in kept),
                   persisted_step=min(k["persisted_step"] for k in kept),
                   persist_manifest=kept[0]["manifest"])
    if cfg.ps_copies > 1:
        chief = results[ctx.reporter]
        takeovers = [t for s in shards for t in s["takeovers"]]
        # each set's count of every replica's pushes, the lost ones' included: a set closes
        # only once every push it applied is committed, so these are the pushes committed
        by_replica = chief.get("ps_applied_by_replica") or []
        applied = chief.get("ps_applied") or []
        # (sets may differ by a dead replica's last push: whole on one shard, broken off on
        # another; each set's own count is exact)
        committed = [sum(t) for t in by_replica]
        out.update(ps_copies=cfg.ps_copies,
                   pushes_committed=max(committed) if committed else None,
                   pushes_committed_by_set=committed,
                   pushes_committed_by_replica=[max(c) for c in zip(*by_replica)],
                   pushes_acknowledged=sum(r["pushes_committed"] for r in reps),
                   committed_equals_applied=bool(by_replica) and committed == list(applied),
                   ps_applied=chief.get("ps_applied"),
                   resent_pushes=sum(r["resent_pushes"] for r in reps),
                   replicated_pushes=sum(s["replicated_pushes"] for s in shards),
                   takeovers=[{**t, "served_after_s": None if t["first_served_at"] is None
                               else round(t["first_served_at"] - t["detected_at"]
                                          + t["silent_s"], 3)} for t in takeovers],
                   lost_shard_ranks=sorted({int(k) for s in shards
                                            for k in s["lost_shard_ranks"]}))
    if cfg.heartbeat_timeout is not None:
        layout = ctx.grid.layout
        lost = sorted({int(r) for s in shards for r in s["lost_replicas"]})
        why = {str(layout.trainer_rank(r)): next(
            s["lost_replicas"][r] for s in shards if r in s["lost_replicas"]) for r in lost}
        # seconds between the last message from a lost replica and its drop, the longest over
        # the shards: how long the shards waited for a dead replica
        after = {str(layout.trainer_rank(r)): max(
            s["lost_after_s"][r] for s in shards if r in s["lost_after_s"]) for r in lost}
        for rank, r in enumerate(results):  # died after its last push (hpcps.runtime.faults.finish)
            if r.get("lost") and "why" in r:
                why[str(rank)], after[str(rank)] = r["why"], r["after_s"]
        for s in shards:  # server shards lost (--ps-copies > 1)
            for rank, reason in s.get("lost_shard_ranks", {}).items():
                why.setdefault(str(rank), f"server shard {layout.role(int(rank)).shard}: "
                                          f"{reason}")
        out.update(lost_ranks=sorted(int(k) for k in why), lost_why=why,
                   lost_detected_s=after,
                   discarded_pushes=sum(s["discarded_pushes"] for s in shards))
    out.update(_spare_figures(results))
    if cfg.ps_copies > 1:
        out.update(_copies_figures(cfg.ps_copies, shards, out.get("shard_replacements", [])))
    pushed = sum(r["bytes_sent"] for r in reps) / trained
    if cfg.push == "activations":
        # here, not at the top: the declaration imports this module, and imports no NumPy
        from hpcps.compress.bf16 import Wire
        out.update(push_bytes_per_step=round(pushed),
                   dense_push_bytes_per_step=Wire.named(cfg.wire_dtype).itemsize
                   * ctx.full_model.n_params)
    if cfg.compress == "threshold":
        words = sum(r["words_sent"] for r in reps)
        out.update(final_tau=reps[0]["final_tau"] if reps else None,
                   residual_warning=any(r["residual_warning"] for r in reps))
        out.update(push_bytes_per_step=round(pushed), updates_per_step=words / trained,
                   compression_ratio=4 * ctx.full_model.n_params / max(1.0, pushed),
                   bits_per_update=8 * pushed * trained / max(1, words))
    return out


def _spare_figures(results: list[dict]) -> dict:
    """--spares: every replacement, with the seconds from the death's detection (and from the
    replica's last sign of life) to the spare's first step; the replicas that left."""
    left = [rank for rank, r in enumerate(results) if r.get("left") and not r.get("dropped")]
    dropped = [rank for rank, r in enumerate(results) if r.get("dropped")]
    gone = {**({"left_ranks": left} if left else {}),
            **({"dropped_ranks": dropped} if dropped else {})}
    chief = results[0]
    if "replacements" not in chief:
        return gone
    joined = {r["as_replica"]: r for r in results if r.get("as_replica") is not None}
    recs = []
    for rec in chief["replacements"]:  # the first step as the spare told the chief, or later
        first = rec["first_step_at"] or joined.get(rec["as_replica"], {}).get("first_step_at")
        again = None if first is None else round(first - rec["detected_at"], 3)
        recs.append({**rec, "training_again_s": again,
                     "since_last_sign_s": None if again is None
                     else round(again + rec["silent_s"], 3)})
    joins = []
    took = {r["spare_rank"]: r for r in recs}  # spares that replaced a dead replica
    for rec in chief.get("joins", []):  # ranks that joined from a second launch (--joins)
        if rec["as_replica"] is None and rec["rank"] in took:  # joined idle, replaced later
            t = took[rec["rank"]]
            joins.append({**rec, "as_replica": t["as_replica"], "data_shard": t["data_shard"],
                          "replaced": t["replica"], "training_after_s": None})
            continue
        first = rec["first_step_at"] or joined.get(rec["as_replica"], {}).get("first_step_at")
        joins.append({**rec, "training_after_s": None if first is None or rec["as_replica"]
                      is None else round(first - rec["at"], 3)})
    return {"spares": chief["spares"], "replacements": recs, "joins": joins,
            "shard_replacements": chief.get("shard_replacements", []),
            "spares_idle_at_end": chief["spares_idle_at_end"], "left_ranks": left, **gone}


def _copies_figures(copies: int, shards: list[dict], replaced: list[dict]) -> dict:
    """--ps-copies: how many copies each set had at the end (as its last primary counted:
    the live holders that hold its whole state), and for each dead shard a spare replaced,
    when every set it held was whole on the spare (``copies_again_s``, from the death's
    detection; ``copies_again_since_last_sign_s``, from the dead shard's last message)."""
    at_end: dict[int, int] = {}
    for s in shards:
        for h, n in s.get("copies_at_end", {}).items():
            at_end[int(h)] = n
    recs = []
    for rep in replaced:
        # when each set was whole on the spare: as the spare told rank 0, saw its state come,
        # or as the primary saw it acknowledged (whichever survived to report)
        whole: dict[int, float] = {int(h): t for h, t in rep.get("restored_at", {}).items()}
        for s in shards:
            for x in s.get("heals", []):
                if x["to_shard"] == rep["as_shard"] and x["restored_at"] is not None:
                    whole[x["set"]] = min(whole.get(x["set"], x["restored_at"]),
                                          x["restored_at"])
            if s["shard"] == rep["as_shard"]:
                for h, t in s.get("filled_at", {}).items():
                    whole[int(h)] = min(whole.get(int(h), t), t)
        again = round(max(whole.values()) - rep["detected_at"], 3) if whole else None
        recs.append({**rep, "sets_restored": sorted(whole),
                     "copies_again_s": again,
                     "copies_again_since_last_sign_s": None if again is None
                     else round(again + rep["silent_s"], 3)})
    return {"copies_at_end": {h: at_end[h] for h in sorted(at_end)},
            "sets_with_c_copies_at_end": sum(n >= copies for n in at_end.values()),
            "shard_replacements": recs}


def join_line(j: dict) -> str:
    """The summary's line for a rank that joined (a record of ``joins``)."""
    return f"rank {j['rank']} joined the run as spare {j['spare']}" + (
        f": replica {j['as_replica']} on data shard {j['data_shard']}"
        + (f", in dead replica {j['replaced']}'s place" if j.get("replaced") is not None
           else f", training {j['training_after_s']:.2f} s after it joined"
           if j["training_after_s"] is not None else ", never trained")
        if j["as_replica"] is not None else
        ", released at once (the run was over)" if j["wants"] == "released" else
        ", idle until the end")


def summary_lines(f: dict) -> list[str]:
    lines = []
    lines += row_lines(f)
    if "compression_ratio" in f:
        lines.append(f"{f['updates_per_step']:.0f} updates per step, {f['bits_per_update']:.1f} "
                     f"bits per update, compression {f['compression_ratio']:.0f}x of the dense "
                     "gradient")
    if "dense_push_bytes_per_step" in f:
        lines.append(f"pushed {f['push_bytes_per_step']:.0f} bytes per step of layer inputs and "
                     f"errors instead of {f['dense_push_bytes_per_step']} of gradient")
    if f.get("lost_ranks"):
        kinds = "rank(s)" if f.get("lost_shard_ranks") else "replica rank(s)"
        lines.append(f"lost {kinds} {f['lost_ranks']} during the run ("
                     + "; ".join(f"rank {k}: {v}" for k, v in f["lost_why"].items())
                     + f"); {f['discarded_pushes']} late push(es) from them discarded; the "
                     "others finished the run")
    if f.get("left_ranks"):
        lines.append(f"rank(s) {f['left_ranks']} left the run on SIGTERM, every push of theirs "
                     "committed")
    if f.get("dropped_ranks"):
        lines.append(f"rank(s) {f['dropped_ranks']} were alive but silent past the heartbeat "
                     "timeout: the shards dropped them, told them so, and they left")
    for r in f.get("replacements", []):
        gone = "died" if r["how"] == "lost" else "left"
        if r["spare"] is None:
            lines.append(f"replica {r['replica']} (rank {r['rank']}) {gone}; no spare was "
                         "left to take its data shard")
            continue
        when = ("did not start training" if r["training_again_s"] is None else
                f"trained {r['training_again_s']:.2f} s after the "
                + ("death was detected" if gone == "died" else "replica left")
                + (f" ({r['since_last_sign_s']:.2f} s after its last sign of life)"
                   if gone == "died" else ""))
        lines.append(f"replica {r['replica']} (rank {r['rank']}) {gone}: spare {r['spare']} "
                     f"(rank {r['spare_rank']}) took data shard {r['data_shard']} as replica "
                     f"{r['as_replica']} and {when}")
    for r in f.get("shard_replacements", []):
        lines.append(f"server shard {r['shard']} (rank {r['rank']}) died: "
                     + (f"spare {r['spare']} (rank {r['spare_rank']}) became shard "
                        f"{r['as_shard']}, holding sets {r['sets_restored']} "
                        + (f"{r['copies_again_s']:.2f} s after the death was detected"
                           if r["copies_again_s"] is not None else "(not all restored)")
                        if r["spare"] is not None else "no spare was left to restore its copies"))
    if "copies_at_end" in f and f["copies_at_end"]:
        lines.append(f"{f['sets_with_c_copies_at_end']} of {len(f['copies_at_end'])} chunk sets "
                     "ended with all their copies")
    lines += [join_line(j) for j in f.get("joins", [])]
    if "spares" in f:
        lines.append(f"{f['spares']} spare(s)"
                     + (f" and {len(f['joins'])} rank(s) that joined" if f.get("joins") else "")
                     + f", {f['spares_idle_at_end']} still idle at the end")
    if "ps_copies" in f:
        applied = f["ps_applied"] or []
        line = (f"{f['ps_copies']} copies of every chunk set: "
                f"{'/'.join(map(str, sorted(set(f['pushes_committed_by_set']))))} pushes "
                "committed to the sets, every replica's (those lost included; "
                f"{f['pushes_acknowledged']} acknowledged to replicas that finished), applied "
                f"to them {sorted(set(applied))} time(s)")
        if not f["committed_equals_applied"]:
            line += " (MISMATCH: a set applied a different count than its replicas' pushes)"
        for t in f["takeovers"]:
            line += (f"; set {t['set']} taken over by shard {t['by_shard']} from shard "
                     f"{t['from_shard']} (silent "
                     f"{t['silent_s']:.1f} s), serving again "
                     + (f"{t['served_after_s']:.1f} s after its last sign of life"
                        if t["served_after_s"] is not None else "never (no request came)"))
        if f["resent_pushes"]:
            line += f"; {f['resent_pushes']} uncommitted push(es) sent again to a new primary"
        lines.append(line)
    if "epoch_quorum" in f:
        counted = sorted(set(zip(f["epoch_finished"], f["epoch_counted"])))
        left = any(a < math.ceil(f["epoch_quorum"] * b - 1e-9) for a, b in counted)
        lines.append(f"epoch quorum {f['epoch_quorum']:g}: {f['epochs_ended']} of "
                     f"{f['epochs_planned']} epoch(s) ended, when "
                     + ", ".join(f"{a} of {b}" for a, b in counted)
                     + " replicas had run their share"
                     + (" (the others had left the run)" if left else "")
                     + "; stragglers left "
                     f"{f['epoch_left_steps']} mini-batch(es) of their shares to the next "
                     f"epoch; epochs took {', '.join(f'{t:.1f}' for t in f['epoch_s'])} s")
    if "persist_every_s" in f:
        lines.append(f"persisted every {f['persist_every_s']:g} s: {f['persist_flushes']} "
                     f"flush(es) of {f['persist_bytes'] / 2**20:.1f} MiB in all "
                     f"({f['persist_skipped_rounds']} round(s) skipped while the writer was "
                     f"busy); at most {f['persist_max_window_steps']} step(s) applied and not "
                     f"yet on disk; {f['persist_manifest']} reads the shards' files at step "
                     f"{f['persisted_step']}")
    lines.append(f"staleness: mean {f['mean_staleness']:.2f}, max {f['max_staleness']:.0f} "
                 "shard updates between a replica's fetch and its push")
    if "softsync" in f:
        lines.append(f"softsync {f['softsync']}: {f['pushes_per_update']:.2f} pushes combined per "
                     f"shard update; staleness-scaled rates: {f['staleness_lr']}")
    if "staleness_bound" in f:
        lines.append(f"staleness bound {f['staleness_bound']}: largest lead over the slowest "
                     f"replica {f['clock_lead_max']} steps; {f['ssp_held_fetches']:.0f} fetches "
                     f"held per shard, {f['ssp_held_s']:.2f} s in all")
    return lines
