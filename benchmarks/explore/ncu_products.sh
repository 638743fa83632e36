#!/usr/bin/env bash
# Nsight Compute sections of the products issue 11 still misses (device call: `bash benchmarks/explore/ncu_products.sh`,
# carry .whl): Block-ELL 64x64 s = 0.9 and 32x32 s = 0.6 at 4096^3, N:M 1:8 (256-row vectors), and 64x64 at 8192^3 beside.
# Each product runs once to tune (the configuration lands in INSUM_CACHE_DIR), then under ncu.
pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
mkdir -p $OUT/r; which ncu > $OUT/r/ncu.log 2>&1
for case in "--block 64 --sparsity 0.9" "--nm 1:8 --vector-len 256" "--block 32 --sparsity 0.6" "--block 64 --sparsity 0.9 --size 8192"; do
  echo "=== $case" >> $OUT/r/ncu.log
  timeout 60 python -m benchmarks.explore.block_ncu $case >> $OUT/r/ncu.log 2>&1
  timeout 90 ncu --clock-control none --kernel-name regex:insum --launch-count 1 --section SpeedOfLight --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section LaunchStats \
    python -m benchmarks.explore.block_ncu $case >> $OUT/r/ncu.log 2>&1
done
grep -c "" $OUT/r/ncu.log
