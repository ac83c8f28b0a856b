"""Medians over the alternated runs of call 5: fused graph us, eff/fill, one-rank publish graph us."""

import glob
import json
import statistics
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else "call5-bench"
runs = {}
for path in sorted(glob.glob(f"{folder}/bench_store-*-*.json")):
    tree = path.rsplit("/", 1)[1].split("-")[1]
    for row in json.load(open(path))["rows"]:
        key = (row["T"], row["dests"], row["slots"])
        runs.setdefault((tree, key), []).append(row)
keys = sorted({k for (_, k) in runs})
med = lambda tree, key, f: statistics.median(r[f] for r in runs[(tree, key)])  # noqa: E731
print(
    "| T | D | slots | OLD fused graph us | NEW | OLD eff/fill | NEW | OLD publish 1-rank us | NEW | NEW/OLD fused |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for k in keys:
    o, n = med("OLD", k, "fused_graph_us"), med("NEW", k, "fused_graph_us")
    print(
        f"| {k[0]} | {k[1]} | {k[2]} | {o:.3g} | {n:.3g} | {med('OLD', k, 'eff/fill'):.3f} | "
        f"{med('NEW', k, 'eff/fill'):.3f} | {med('OLD', k, 'publish_1rank_graph_us'):.3g} | "
        f"{med('NEW', k, 'publish_1rank_graph_us'):.3g} | {n / o:.3f} |"
    )
