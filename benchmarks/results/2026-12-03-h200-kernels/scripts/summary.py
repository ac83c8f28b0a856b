"""Medians over alternated bench_store.py runs of two kernel trees, as a Markdown table: fused
graph us, eff/fill and one-rank publish graph us of each tree, and the NEW/OLD ratio of one
column. The runs are JSON files named bench_store-<TREE>-<i>.json in one folder.

usage: summary.py FOLDER [OLD NEW] [--ratio fused|publish] [--sort]
  stores-summary.md of this folder:      summary.py stores PREV NEW --ratio publish
  ../2026-12-03-h200-block-shift/stores-summary.md:
                                         summary.py stores-old-vs-new OLD NEW --ratio fused --sort
Rows sorted by T and destinations, slot patterns in the runs' order (--sort: by name).
"""

import argparse
import glob
import json
import statistics

p = argparse.ArgumentParser()
p.add_argument("folder")
p.add_argument("old", nargs="?", default="OLD")
p.add_argument("new", nargs="?", default="NEW")
p.add_argument("--ratio", choices=("fused", "publish"), default="fused")
p.add_argument("--sort", action="store_true")
a = p.parse_args()
runs: dict = {}
keys: list = []
for path in sorted(glob.glob(f"{a.folder}/bench_store-*-*.json")):
    tree = path.rsplit("/", 1)[1].split("-")[1]
    for row in json.load(open(path))["rows"]:
        key = (row["T"], row["dests"], row["slots"])
        if key not in keys:
            keys.append(key)
        runs.setdefault((tree, key), []).append(row)
keys.sort(key=lambda k: k if a.sort else k[:2])
med = lambda tree, key, f: statistics.median(r[f] for r in runs[(tree, key)])  # noqa: E731
field = {"fused": "fused_graph_us", "publish": "publish_1rank_graph_us"}[a.ratio]
o, n = a.old, a.new
print(
    f"| T | D | slots | {o} fused graph us | {n} | {o} eff/fill | {n} | {o} publish 1-rank us | {n} "
    f"| {n}/{o} {a.ratio} |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for k in keys:
    print(
        f"| {k[0]} | {k[1]} | {k[2]} | {med(o, k, 'fused_graph_us'):.3g} | {med(n, k, 'fused_graph_us'):.3g} "
        f"| {med(o, k, 'eff/fill'):.3f} | {med(n, k, 'eff/fill'):.3f} "
        f"| {med(o, k, 'publish_1rank_graph_us'):.3g} | {med(n, k, 'publish_1rank_graph_us'):.3g} "
        f"| {med(n, k, field) / med(o, k, field):.3f} |"
    )
