"""The summary of an embedding model's rows on the server shards, for the strategies that
train one: figures from every shard's result, and the lines on the terminal. Pure."""
from __future__ import annotations


def row_figures(cfg, shards: list[dict], replicas: list[dict], trained: int) -> dict:
    """Rows held (in all, per table, per shard), rows a step pulls and pushes, the largest
    resident size of a shard's rows, and what capacity and admission did (summed over the
    shards), from the shards' and replicas' results."""
    by_table = [sum(col) for col in zip(*(s["rows_held"] for s in shards))]
    out = {"rows_held": sum(by_table), "rows_held_by_table": by_table,
           "rows_held_per_shard": [sum(s["rows_held"]) for s in shards],
           "rows_per_step": sum(r.get("rows_pulled", 0) for r in replicas) / max(1, trained),
           "row_bytes_resident_per_shard": [s["row_bytes_resident"] for s in shards]}
    if cfg.table_capacity is not None or (cfg.admit_after or 1) > 1:
        out.update(table_capacity=cfg.table_capacity, admit_after=cfg.admit_after or 1,
                   rows_evicted=sum(s["rows_evicted"] for s in shards),
                   row_grads_dropped=sum(s["row_grads_dropped"] for s in shards),
                   ids_zeroed=sum(s["ids_zeroed"] for s in shards))
    return out


def row_lines(f: dict) -> list[str]:
    lines = []
    if "rows_held" in f:
        per = f["rows_held_per_shard"]
        lines.append(f"embedding rows: {f['rows_held']} held over {len(per)} shard(s) "
                     f"({min(per)}-{max(per)} per shard, "
                     f"{max(f['row_bytes_resident_per_shard']) / 2**20:.1f} MiB at most), "
                     f"{f['rows_per_step']:.0f} pulled and pushed per step")
    if "rows_evicted" in f:
        cap = f["table_capacity"]
        lines.append(f"table capacity {cap if cap is not None else 'unbounded'}"
                     + (" rows per table and shard" if cap is not None else "")
                     + f", admission after {f['admit_after']} sighting(s): "
                     f"{f['rows_evicted']} rows evicted, {f['row_grads_dropped']} row "
                     "gradients dropped (row evicted since its pull, or not admitted), "
                     f"{f['ids_zeroed']} ids answered zeros before admission")
    return lines
