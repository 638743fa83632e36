#!/usr/bin/env bash
# Nsight Compute of the conv's gathered-rows statement at 120 and 128 channels (device call: `bash
# benchmarks/explore/ncu_channels.sh`, carry .whl). Each runs once to tune, then under ncu.
pip install -q --no-index --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
mkdir -p $OUT/r
for c in 120 128; do
  echo "=== $c channels" >> $OUT/r/ncu_channels.log
  timeout 40 python -m benchmarks.explore.channels_ncu --channels $c >> $OUT/r/ncu_channels.log 2>&1
  timeout 60 ncu --clock-control none --kernel-name regex:insum --launch-count 1 --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis \
    --metrics l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,smsp__inst_executed_op_global_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum \
    python -m benchmarks.explore.channels_ncu --channels $c >> $OUT/r/ncu_channels.log 2>&1
done
grep -E "===|tuned|Duration|Throughput|sectors|requests|inst_executed|Registers|Shared Memory Config|Achieved Occupancy|Block Limit|L1/TEX Hit|L2 Hit" $OUT/r/ncu_channels.log | head -80
