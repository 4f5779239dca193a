"""Render the measurement tables of docs/ and the README from the files in bench/results/.

A table is generated where a Markdown file holds the marker pair::

    <!-- results: bench_hogwild-2026-11-26-amd-epyc#ratios -->
    ... (generated: do not edit) ...
    <!-- /results -->

naming one results file (its stem in ``bench/results/``) and one table in it. Between the
markers this script writes a caption line (date, CPU, command, and where the figures came
from) and the table. A results file is what ``machine.save`` wrote when a bench ran: its
``figures`` become tables through the bench's view below (``VIEWS``); a file may also carry
its tables ready-made under ``tables`` (``{"name": {"columns": [...], "rows": [[...]]}}``),
which is how figures measured before the benches wrote files were transcribed from the docs
(those files say so in ``transcribed_from``).

Usage::

    python bench/render.py            # rewrite every marked table in place
    python bench/render.py --check    # exit 1 naming each table that differs from its file

``tests/test_docs.py`` runs the check, so a table edited by hand, or a results file changed
without rendering again, fails the tests.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ("README.md", "bench/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))

BLOCK = re.compile(r"(<!-- results: (?P<ref>[^ ]+?) -->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.S)


class RenderError(Exception):
    """A marker that names a file or table that does not exist."""


def markdown_table(table: dict) -> str:
    """``{"columns": [...], "rows": [[...], ...], "align": [...]}`` as a Markdown table."""
    cols = table["columns"]
    align = table.get("align") or ["---"] * len(cols)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
    for row in table["rows"]:
        if len(row) != len(cols):
            raise RenderError(f"a row of {len(row)} cells under {len(cols)} columns: {row}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def _x(v) -> str:
    return "" if v is None else f"{v:.2f}x"


def _eps(entry: dict | None) -> str:
    if not entry:
        return ""
    return f"{round(entry['examples_per_s'], -1):,.0f}"


def hogwild_view(figures: dict) -> dict:
    """bench_hogwild: the paired ratios per model (``ratios``) and examples/s (``examples``)."""
    models = figures["models"]
    rows = (("hpcps / PyTorch, T = 1", "hogwild_over_torch_T1"),
            ("hpcps / PyTorch, T = 2", "hogwild_over_torch_T2"),
            ("hpcps T = 2 / T = 1", "hogwild_T2_over_T1"),
            ("PyTorch T = 2 / T = 1", "torch_T2_over_T1"),
            ("zero skipping on / off, T = 1", "zero_skip_gain_T1"),
            ("zero skipping on / off, T = 2", "zero_skip_gain_T2"),
            ("MKL / OpenBLAS in the engine, T = 1", "mkl_gain_T1"),
            ("MKL / OpenBLAS in the engine, T = 2", "mkl_gain_T2"))
    keys = list(models)
    ratios = {"columns": [f"ratio (paired medians of {figures['repeats']})", *keys],
              "rows": [[label, *(_x(models[k]["paired_ratios_median"].get(key)) for k in keys)]
                       for label, key in rows
                       if any(key in models[k]["paired_ratios_median"] for k in keys)]}
    examples = {"columns": ["model", "T", "hpcps", "hpcps, MKL", "hpcps, no zero skipping",
                            "PyTorch"], "rows": []}
    for k in keys:
        res = models[k]["results"]
        for t in ("T1", "T2"):
            examples["rows"].append([k, t[1:], _eps(res.get(f"hogwild_{t}")),
                                     _eps(res.get(f"hogwild_{t}_mkl")),
                                     _eps(res.get(f"hogwild_{t}_no_zero_skip")),
                                     _eps(res.get(f"torch_{t}"))])
    return {"ratios": ratios, "examples": examples}


def embeddings_view(figures: dict) -> dict:
    """bench_embeddings: ``throughput`` (per rank count), ``movielens`` (the AUC against the
    logistic regression), ``memory`` (resident bytes per shard against rows/S x bytes a row)."""
    out = {}
    tp = figures.get("throughput")
    if tp:
        out["throughput"] = {
            "columns": ["ranks", "replicas + shards", "batch", "examples/s (median)",
                        "instances/s per core", "rows per step", "bytes per step",
                        "dense equivalent", "test AUC"],
            "rows": [[r["ranks"], f"{r['replicas']} + {r['servers']}", r["batch_size"],
                      f"{r['examples_per_s']:,.0f}", f"{r['instances_per_s_per_core']:,.0f}",
                      f"{r['rows_per_step']:,.0f}", f"{r['bytes_per_step'] / 2**20:.1f} MiB",
                      f"{r['dense_equivalent_bytes_per_step'] / 2**30:,.0f} GiB",
                      f"{r['test_auc']:.4f}"] for r in tp["runs"]]}
    ml = figures.get("movielens")
    if ml:
        out["movielens"] = {
            "columns": ["run", "test AUC", "against LogisticRegression()"],
            "rows": [*[[f"seed {i}", f"{a:.4f}", f"{a - ml['logistic_regression_auc']:+.4f}"]
                       for i, a in enumerate(ml["test_auc_all"])],
                     ["median", f"{ml['test_auc']:.4f}", f"{ml['auc_gain']:+.4f}"],
                     ["scikit-learn LogisticRegression() on the one-hot fields",
                      f"{ml['logistic_regression_auc']:.4f}", ""]]}
    mem = figures.get("memory")
    if mem:
        out["memory"] = {
            "columns": ["shards S", "rows per shard", "resident growth per shard",
                        "rows/S x bytes a row", "ratio"],
            "rows": [[m["shards"], f"{m['per_shard'][0]['rows']:,}",
                      " / ".join(f"{r['rss_growth_bytes'] / 2**20:,.0f} MiB"
                                 for r in m["per_shard"]),
                      f"{m['per_shard'][0]['nominal_bytes'] / 2**20:,.0f} MiB "
                      f"({m['bytes_per_row']} B)",
                      " / ".join(f"{r['growth_over_nominal']:.2f}" for r in m["per_shard"])]
                     for m in mem]}
    return out


def peers_view(figures: dict) -> dict:
    """bench_peers: time to 97% and 98% per configuration (medians and every run)."""
    def cell(c, key):
        med, runs = c[f"time_to_{key}_s_median"], c[f"time_to_{key}_s_all"]
        shown = ", ".join("-" if r is None else f"{r:.1f}" for r in runs)
        return f"{'-' if med is None else f'{med:.1f}'} ({shown})"
    rows = [[name.replace("_", " "), cell(c, "97"), cell(c, "98"),
             " / ".join(f"{a:.2%}" for a in c["final_accuracy_all"])]
            for name, c in figures["configs"].items()]
    ratio = figures.get("time_to_97_ratio")
    rows.append(["hpcps's best / PyTorch's best, time to 97%",
                 "-" if ratio is None else f"{ratio:.2f}x", "", ""])
    return {"time_to_accuracy": {
        "columns": ["configuration", "s to 97%: median (runs)", "s to 98%: median (runs)",
                    "final accuracy"], "rows": rows}}


def _joins(figures: dict) -> str:
    """How many ranks joined the soak's job, how many replaced a dead replica, and the
    exit codes of the join launches whose rank was not killed."""
    joined = {j["rank"] for j in figures.get("join_records") or []}
    took = [r for r in figures["replacements"] if r.get("spare_rank") in joined
            and r.get("training_again_s") is not None]
    codes = sorted(set((figures.get("join_exit_codes") or {}).values()))
    return (f"{figures['joins']}; {len(took)} of them replaced a dead replica and trained"
            + (f"; the launches not killed exited with {', '.join(map(str, codes))}"
               if codes else ""))


def soak_view(figures: dict) -> dict:
    """soak_elastic: what the kills did to the run (``outcome``)."""
    kills = figures["kills"]
    roles = [k["role"] for k in kills]
    first, last = (kills[0]["t_s"], kills[-1]["t_s"]) if kills else (0.0, 0.0)
    sets = figures["sets"]

    def seconds(v) -> str:
        return "-" if v is None else f"{v:.3g} s"
    rows = [
        ["kills", f"{len(kills)}, from {first:.0f} s to {last:.0f} s into the run: "
                  f"{roles.count('replica')} replicas, "
                  f"{roles.count('shard')} shards (spares that had taken over included)"],
        ["completed; sets at C copies at the end",
         f"{'yes' if figures['completed'] else 'no'}; "
         f"{figures['sets_with_c_copies_at_end']} of {sets}"],
        ["pushes committed = applied, per set",
         f"{'yes' if figures['committed_equals_applied'] else 'no'}: " + " / ".join(
             f"{n:,}" for n in figures["pushes_committed_by_set"] or [])],
        ["a dead replica's data shard training again, after its death was detected",
         f"median {seconds(figures['replaced_median_s'])}, max "
         f"{seconds(figures['replaced_max_s'])}"],
        ["a dead shard's sets back at C copies, after its death was detected",
         f"median {seconds(figures['copies_again_median_s'])}, max "
         f"{seconds(figures['copies_again_max_s'])}"],
        ["a set served again after its primary's last sign of life",
         ", ".join(seconds(v) for v in figures["shard_failover_s"]) or "-"],
        ["test accuracy", f"{figures['accuracy']:.2%}, the same job without kills "
                          f"{figures['clean_accuracy']:.2%}"],
        ["ranks that joined (idle spares, `hpcps.join`)", _joins(figures)],
    ]
    return {"outcome": {"columns": ["figure", "value"], "rows": rows}}


def wire_view(figures: dict) -> dict:
    """bench_wire: bf16 against fp32 on the emulated network (``throughput``) and on MNIST
    (``accuracy``)."""
    out = {}
    rows = []
    for net in figures.get("networks", []):
        for e in net["throughput"]:
            if "error" in e:
                rows.append([net["rate"], e["strategy"], str(e["ranks"]), "failed", "", "", ""])
                continue
            rows.append([net["rate"], e["strategy"], str(e["ranks"]),
                         f"{e['fp32']['examples_per_s']:,.0f}",
                         f"{e['bf16']['examples_per_s']:,.0f}",
                         f"{e['speedup_median']:.2f}x ("
                         + ", ".join(f"{r:.2f}" for r in e["speedup_all"]) + ")",
                         f"{e['fp32']['bytes_per_step']:,.0f} -> "
                         f"{e['bf16']['bytes_per_step']:,.0f}"])
    if rows:
        out["throughput"] = {"columns": ["network", "strategy", "ranks", "fp32 examples/s",
                                         "bf16 examples/s", "bf16 / fp32: median (pairs)",
                                         "bytes per step"], "rows": rows}
    rows = []
    for e in figures.get("accuracy", []):
        cells = [f"{e[w]['test_accuracy']:.2%}" if "test_accuracy" in e[w] else "failed"
                 for w in ("fp32", "bf16")]
        lost = e.get("points_lost")
        rows.append([e["strategy"], str(e["ranks"]), *cells,
                     "-" if lost is None else f"{lost:+.2f}"])
    if rows:
        out["accuracy"] = {"columns": ["strategy", "ranks", "fp32 test accuracy",
                                       "bf16 test accuracy", "points lost"], "rows": rows}
    return out


def check_view(figures: dict) -> dict:
    """bench_cluster --check-model: the scaling model against this machine's runs
    (``speed``: 2 ranks, a core each; ``bytes``: every rank count)."""
    rows = []
    for r in figures["rows"]:
        if r["check"] != "speed" or "predicted" not in r:
            continue
        in_run = r.get("relative_difference_in_run")
        rows.append([r["layers"], r["network"], r["strategy"], f"{r['measured']:,.0f}",
                     f"{r['predicted']:,.0f}", f"{r['relative_difference']:+.0%}",
                     f"{in_run:+.0%}" if in_run is not None else "-"])
    speed = {"columns": ["model", "network", "strategy", "measured examples/s",
                         "predicted", "difference", "with the run's own pass"], "rows": rows}
    rows = []
    for r in figures["rows"]:
        if "bytes_relative_difference" not in r:
            continue
        rows.append([r["check"], r["layers"], r["strategy"], str(r["ranks"]),
                     f"{r['bytes_measured']:,.0f}", f"{r['bytes_model']:,.0f}",
                     f"{r['bytes_relative_difference']:+.1%}"])
    sizes = {"columns": ["run", "model", "strategy", "ranks", "bytes per step counted",
                         "predicted", "difference"], "rows": rows}
    w, b = figures["within_15pct"], figures["bytes_within_5pct"]
    in_run = [r["relative_difference_in_run"] for r in figures["rows"]
              if r["check"] == "speed" and r.get("relative_difference_in_run") is not None]
    verdict = {"columns": ["check", "passed"],
               "rows": [["examples/s within 15%", f"{w['passed']} of {w['of']}"],
                        *([["the same, with each run's own pass time",
                            f"{sum(abs(d) <= 0.15 for d in in_run)} of {len(in_run)}"]]
                          if in_run else []),
                        ["bytes per step within 5%", f"{b['passed']} of {b['of']}"]]}
    return {"speed": speed, "bytes": sizes, "verdict": verdict}


def stream_view(figures: dict) -> dict:
    """bench_stream: streamed against in-memory training (``examples``), and what a reading
    thread does to a training thread (``interference``)."""
    rows = []
    figure = figures.get("learned_figure", "test_accuracy")  # test_auc: an embedding model
    shown = "{:.3f}" if figure == "test_auc" else "{:.2%}"
    for model, m in figures["models"].items():
        med = m["median_examples_per_s"]
        runs = m["runs"]
        rows.append([model, f"{med['memory']:,.0f} ("
                     + ", ".join(f"{r['examples_per_s']:,.0f}" for r in runs["memory"]) + ")",
                     f"{med['stream']:,.0f} ("
                     + ", ".join(f"{r['examples_per_s']:,.0f}" for r in runs["stream"]) + ")",
                     f"{m['stream_over_memory']:.2f}x",
                     shown.format(runs["memory"][0][figure]) + " / "
                     + shown.format(runs["stream"][0][figure])])
    what = "test AUC" if figure == "test_auc" else "test accuracy"
    out = {"examples": {"columns": ["model", "in memory: median (runs)",
                                    "streamed: median (runs)", "streamed / in memory",
                                    f"{what}, memory / streamed"], "rows": rows}}
    ri = figures.get("reader_interference")
    if ri:
        out["interference"] = {"columns": ["beside the training thread", "steps/s (median)",
                                           "relative"],
                               "rows": [[k, f"{ri['median'][k]:,.0f}", f"{ri['relative'][k]:.2f}"]
                                        for k in ri["median"]]}
    return out


def modelpar_conv_view(figures: dict) -> dict:
    """bench_modelpar --conv: a partitioned conv net on the compiled engine against NumPy."""
    rows = []
    for model, per_p in (figures.get("conv_speedup") or {}).items():
        for P, e in per_p.items():
            rows.append([model, P, f"{e['numpy']:,.0f}", f"{e['compiled']:,.0f}",
                         f"{e['ratio']:.2f}x"])
    return {"conv_speedup": {"columns": ["model", "P", "NumPy examples/s",
                                         "compiled examples/s", "compiled / NumPy"],
                             "rows": rows}} if rows else {}


# bench name -> figures -> {table name: table}; a bench without a view renders only the
# tables its files carry ready-made
def trace_merge_view(figures: dict) -> dict:
    """bench_trace --merge-only: the end of a traced run (each rank's pack, rank 0's merge)."""
    return {"merge": {"columns": ["ranks", "events per rank", "a rank packs its events (s)",
                                  "rank 0 merges them (s)", "trace.json"],
                      "rows": [[m["ranks"], f"{m['events_per_rank']:,}",
                                f"{m['pack_s_per_rank']:.2f}", f"{m['merge_s_on_rank_0']:.2f}",
                                f"{m['file_bytes'] / 1e6:,.0f} MB"] for m in figures["merge"]]}}


VIEWS = {"bench_hogwild": hogwild_view, "bench_embeddings": embeddings_view,
         "bench_peers": peers_view, "soak_elastic": soak_view, "bench_wire": wire_view,
         "bench_cluster_check": check_view, "bench_stream": stream_view,
         "bench_modelpar": modelpar_conv_view, "bench_trace_merge": trace_merge_view}


def load(stem: str) -> dict:
    path = RESULTS / f"{stem}.json"
    if not path.is_file():
        raise RenderError(f"no results file bench/results/{stem}.json")
    return json.loads(path.read_text())


def tables_of(doc: dict) -> dict:
    tables = dict(doc.get("tables") or {})
    view = VIEWS.get(doc.get("bench"))
    if view is not None and doc.get("figures"):
        tables.update(view(doc["figures"]))
    return tables


def caption(doc: dict, stem: str) -> str:
    m = doc.get("machine") or {}
    cpu = m.get("cpu") or "CPU not recorded"
    if m.get("cores"):
        cpu += f", {m['cores']} cores"
    if m.get("cpu_features"):
        cpu += " (" + " ".join(m["cpu_features"]) + ")"
    source = (f"transcribed from {doc['transcribed_from']} into" if doc.get("transcribed_from")
              else "from")
    note = f"; {doc['note']}" if doc.get("note") else ""
    return (f"*{doc['date']}, {cpu}: `{doc['command']}` ({source} "
            f"`bench/results/{stem}.json`{note})*\n")


def render_block(ref: str) -> str:
    stem, _, name = ref.partition("#")
    doc = load(stem)
    tables = tables_of(doc)
    if name not in tables:
        raise RenderError(f"bench/results/{stem}.json has no table {name!r} "
                          f"(it has: {', '.join(sorted(tables)) or 'none'})")
    return caption(doc, stem) + "\n" + markdown_table(tables[name])


def render_text(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked table rendered, and the refs of those that changed."""
    changed: list[str] = []

    def one(m: re.Match) -> str:
        body = render_block(m["ref"])
        if body != m["body"]:
            changed.append(m["ref"])
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 naming every table that differs from its file")
    a = p.parse_args(argv)
    stale = []
    for rel in DOCS:
        path = ROOT / rel
        if not path.is_file():
            continue
        text = path.read_text()
        try:
            new, changed = render_text(text)
        except RenderError as exc:
            print(f"render: {rel}: {exc}", file=sys.stderr)
            return 2
        stale += [f"{rel}: {ref}" for ref in changed]
        if changed and not a.check:
            path.write_text(new)
    for line in stale:
        print(("differs from its results file: " if a.check else "rendered: ") + line)
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
