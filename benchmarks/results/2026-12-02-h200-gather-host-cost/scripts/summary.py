"""Medians over the runs of scripts/ab_host_cost.sh: stage, T, slot form, OLD, NEW (µs)."""

import glob
import json
import statistics
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else "."
acc: dict = {}
for path in sorted(glob.glob(f"{folder}/host-cost-*.json")):
    tree = path.rsplit("host-cost-", 1)[1].split("-")[0]
    for r in json.load(open(path))["rows"]:
        stage = r["stage"].replace("check_inputs", "check").replace("InputCheck", "check")
        for form in ("own", "gathered"):
            acc.setdefault((stage, r["T"], form), {}).setdefault(tree, []).append(r[form])
print(f"{'stage':<46} {'T':>5} {'slots':<9} {'OLD':>8} {'NEW':>8}  runs")
for (stage, t, form), v in acc.items():
    o, n = statistics.median(v["OLD"]), statistics.median(v["NEW"])
    print(f"{stage:<46} {t:>5} {form:<9} {o:8.1f} {n:8.1f}  {len(v['OLD'])}/{len(v['NEW'])}")
