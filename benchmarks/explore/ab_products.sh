#!/usr/bin/env bash
# A/B of the tensor-core products (explore/ab_products.py): an older insum tree (in
# .carry-ab/old) against this one, alternated in separate processes, ROUNDS times (default 2),
# each process with an empty kernel cache of its own (so each tunes as a user's first call).
#   rm -rf .carry-ab/old && mkdir -p .carry-ab/old && git archive <rev> insum | tar -x -C .carry-ab/old
#   bash benchmarks/explore/ab_products.sh [--quick]   # (device, carry .whl and .carry-ab)
# MODULE=benchmarks.explore.shapes runs another script that takes --label the same way.
pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
MODULE=${MODULE:-benchmarks.explore.ab_products}
NAME=${MODULE##*.}
LOG=ab_${NAME#ab_}.log  # ab_products.log, ab_shapes.log
ROOT=$PWD
OUTDIR=${OUT:-/tmp/out}/r
mkdir -p "$OUTDIR"
rm -rf .carry-ab/old/benchmarks && cp -r benchmarks .carry-ab/old/
for i in $(seq "${ROUNDS:-2}"); do
  for tree in old new; do
    if [ $tree = old ]; then cd "$ROOT/.carry-ab/old"; else cd "$ROOT"; fi
    INSUM_CACHE_DIR=/tmp/insum-cache-$tree-$i PYTHONPATH=/tmp/site:$PWD python -m "$MODULE" --label "$tree" "$@" \
      2>&1 | grep -v "Warn" | tee -a "$OUTDIR/$LOG"
  done
done
