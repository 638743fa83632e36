#!/usr/bin/env bash
# A/B of a SparseLinear step's host time: an older insum tree (in .carry-ab/old, with this
# tree's benchmarks copied beside it) against this one, alternated in separate processes:
# explore/layer_host (the layer's pieces) and explore/mlp_step (the MLP step).
#   rm -rf .carry-ab/old && mkdir -p .carry-ab/old && git archive <rev> insum | tar -x -C .carry-ab/old
#   bash benchmarks/explore/ab_host.sh      # (device, carry .whl and .carry-ab)
pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
ROOT=$PWD
OUTDIR=${OUT:-/tmp/out}/r
mkdir -p "$OUTDIR"
rm -rf .carry-ab/old/benchmarks && cp -r benchmarks .carry-ab/old/
for i in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then cd "$ROOT/.carry-ab/old"; else cd "$ROOT"; fi
    echo "== $tree $i" | tee -a "$OUTDIR/ab.log"
    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.explore.layer_host 2>&1 | grep -v "Warn\|return Var" | tee -a "$OUTDIR/ab.log"
    PYTHONPATH=/tmp/site:$PWD python -m benchmarks.explore.mlp_step --formats dense,Block-ELL 2>&1 \
      | grep -v "^[WI][0-9]\{4\}\|sync:" | tee -a "$OUTDIR/ab.log"
  done
done
