"""The summary of an embedding model's rows on the server shards, for the strategies that
train one: figures from every shard's result, and the line on the terminal. Pure."""
from __future__ import annotations


def row_figures(shards: list[dict], replicas: list[dict], trained: int) -> dict:
    """Rows held (in all, per table, per shard), rows a step pulls and pushes, and the
    largest resident size of a shard's rows, from the shards' and replicas' results."""
    by_table = [sum(col) for col in zip(*(s["rows_held"] for s in shards))]
    return {"rows_held": sum(by_table), "rows_held_by_table": by_table,
            "rows_held_per_shard": [sum(s["rows_held"]) for s in shards],
            "rows_per_step": sum(r.get("rows_pulled", 0) for r in replicas) / max(1, trained),
            "row_bytes_resident_per_shard": [s["row_bytes_resident"] for s in shards]}


def row_lines(f: dict) -> list[str]:
    if "rows_held" not in f:
        return []
    per = f["rows_held_per_shard"]
    return [f"embedding rows: {f['rows_held']} held over {len(per)} shard(s) "
            f"({min(per)}-{max(per)} per shard, "
            f"{max(f['row_bytes_resident_per_shard']) / 2**20:.1f} MiB at most), "
            f"{f['rows_per_step']:.0f} pulled and pushed per step"]
