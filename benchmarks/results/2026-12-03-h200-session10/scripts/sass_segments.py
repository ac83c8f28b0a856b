"""Warp instructions per token of call 6's profiled store_layer (T = 65536, one destination),
by opcode and by part of the kernel. Reads ncu's source page (SASS with per-instruction counts)
``call6/store_layer-sass.csv.gz``. The part boundaries are row numbers of that build's SASS
(kernels of e27f342, sm_90), read off the listing by hand: they hold for that file only."""

import collections
import csv
import gzip
import sys

TOKENS = 65536
PARTS = [
    (0, 167, "loop head, input and slot loads, MLA slot -> block (dest_block_offset)"),
    (167, 577, "MLA: amax, scale, 16 values quantized (4 fast-or-IEEE branches)"),
    (577, 742, "MLA: scale shuffles, dest_range, the line-split stores"),
    (742, 830, "indexer: slot -> block (dest_block_offset again)"),
    (830, 1017, "indexer: 32-lane amax, scale with log2f/exp2f (ue8m0), 4 values"),
    (1017, 1116, "indexer: dest_range, value and scale stores"),
    (1116, 10**9, "loop step"),
]

path = sys.argv[1] if len(sys.argv) > 1 else "call6/store_layer-sass.csv.gz"
rows = list(csv.reader(gzip.open(path, "rt")))
header, body = rows[1], rows[2:]
src, executed = header.index("Source"), header.index("Instructions Executed")
by_op, by_part, total = collections.Counter(), collections.Counter(), 0
for k, row in enumerate(body):
    if len(row) <= executed or not row[executed].isdigit():
        continue
    n = int(row[executed])
    words = row[src].split()
    op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
    by_op[op] += n
    by_part[next(name for a, b, name in PARTS if a <= k < b)] += n
    total += n
print(f"{total} warp instructions, {total / TOKENS:.1f} per token")
for _, _, name in PARTS:
    print(f"{by_part[name] / TOKENS:7.1f}  {name}")
for op, n in by_op.most_common(16):
    print(f"{n / TOKENS:7.1f}  {op}")
