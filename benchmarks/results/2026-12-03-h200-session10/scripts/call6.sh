#!/usr/bin/env bash
# Session 10 device call 6 (nvidia-h200), tree e36826a: where the one-destination store's
# instructions go, for the next step of issue 23 item 3. The SASS of vmmkv_store_layer (the
# cubin NVRTC builds, dumped with cuobjdump) and ncu's per-instruction executed counts for
# store_layer at T = 65536, one destination, consecutive slots (scripts/ncu_one.py).
set -u
export PYTHONUNBUFFERED=1
L=/tmp/call6; mkdir -p $L
PYTHONPATH=$PWD python3 -c "
from vmmkv.ops import build
out = build.compile_all('sm_90')
for name, cubin in out.items():
    data = getattr(cubin, 'cubin', cubin)
    open('$L/' + str(name).replace('/', '_') + '.cubin', 'wb').write(bytes(data))
    print(name, len(bytes(data)))
" 2>&1 | tail -3
for f in $L/*.cubin; do cuobjdump -sass -fun vmmkv_store_layer $f > $f.sass 2>&1; nvdisasm -c $f > $f.nvdisasm 2>&1; wc -l $f.sass $f.nvdisasm; done
PYTHONPATH=$PWD timeout 150 ncu -k regex:'vmmkv_store_layer$' --launch-skip 3 --launch-count 1 \
    --section SourceCounters --section InstructionStats -o $L/store_layer -f \
    python3 benchmarks/results/2026-12-03-h200-session10/scripts/ncu_one.py 65536 > $L/ncu.log 2>&1
echo "ncu rc=$?"
ncu -i $L/store_layer.ncu-rep --page source --print-source sass --csv > $L/store_layer-sass.csv 2>&1
echo "source page rc=$? lines=$(wc -l < $L/store_layer-sass.csv)"
ncu -i $L/store_layer.ncu-rep --page details > $L/store_layer-details.txt 2>&1
tar -C /tmp -czf $OUT/call6.tgz call6
