pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
mkdir -p $OUT/r
for i in 1 2; do
 for tree in old new; do
  if [ $tree = old ]; then P=$PWD/.carry-ab/old; else P=$PWD; fi
  echo "== $tree $i" | tee -a $OUT/r/ab.log
  PYTHONPATH=/tmp/site:$P:$PWD python -m benchmarks.explore.layer_host 2>&1 | grep -v "Warn\|return Var" | tee -a $OUT/r/ab.log
  PYTHONPATH=/tmp/site:$P:$PWD python -m benchmarks.explore.mlp_step --formats dense,Block-ELL 2>&1 | grep -v "^[WI][0-9]\{4\}\|sync:" | tee -a $OUT/r/ab.log
 done
done
