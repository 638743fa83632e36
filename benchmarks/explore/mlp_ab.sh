#!/usr/bin/env bash
# The MLP table of torch_checks (dense, Block-ELL and NM: eager, compiled, graphed) for this
# tree, then for the older tree in .carry-ab/old (as ab_host.sh sets it up), and the layer's
# device time per piece:   bash benchmarks/explore/mlp_ab.sh    (carry .whl and .carry-ab)
pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
ROOT=$PWD
OUTDIR=${OUT:-/tmp/out}/r
mkdir -p "$OUTDIR"
quiet() { grep --line-buffered -v '^[WI][0-9]\{4\} \|Warning\|warn'; }
PYTHONPATH=/tmp/site:$ROOT python -m benchmarks.explore.layer_host --batch 4096 --device-times 2>&1 | quiet | tee "$OUTDIR/layer_device.log"
PYTHONPATH=/tmp/site:$ROOT python -m benchmarks.torch_checks --skip-checks --models "Block-ELL,NM 2:4 L=128" \
  --out "$OUTDIR/torch_mlp_new.json" 2>&1 | quiet | tee "$OUTDIR/mlp_new.log"
rm -rf .carry-ab/old/benchmarks && cp -r benchmarks .carry-ab/old/ && cd .carry-ab/old
PYTHONPATH=/tmp/site:$PWD python -m benchmarks.torch_checks --skip-checks --models "Block-ELL" \
  --out "$OUTDIR/torch_mlp_old.json" 2>&1 | quiet | tee "$OUTDIR/mlp_old.log"
