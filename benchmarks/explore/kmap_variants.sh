#!/usr/bin/env bash
# A/B of the hash probe kernel's memory hints and block size at 1.2M voxels (GPU, ~2 min):
# each variant is a copy of the tree with one edit of insum/nn/kernel_map.py, timed in its
# own process by profile_kmap --time-only; then ncu's memory sections of the base probe.
#   bash benchmarks/explore/kmap_variants.sh [SIZES]     # output under $OUT/kmap_variants/
set -uo pipefail
SIZES=${1:-1200000}
DIR="${OUT:-/tmp/out}/kmap_variants"
mkdir -p "$DIR"
F=insum/nn/kernel_map.py
declare -A EDITS=(
  [base]=''
  [stream_nbr]='s/tl.store(nbr_ptrs, row, mask=/tl.store(nbr_ptrs, row, cache_modifier=".cs", mask=/'
  [stream_nbr_keep_table]='s/tl.store(nbr_ptrs, row, mask=/tl.store(nbr_ptrs, row, cache_modifier=".cs", mask=/; s/entry = tl.load(table_ptr + slot, mask=seeking, other=-1)/entry = tl.load(table_ptr + slot, mask=seeking, other=-1, eviction_policy="evict_last")/; s/tl.load(row_keys_ptr + (held \& ((1 << row_bits) - 1)), mask=alike, other=-1)/tl.load(row_keys_ptr + (held \& ((1 << row_bits) - 1)), mask=alike, other=-1, eviction_policy="evict_last")/'
  [sites8]='s|block_m = max(1, 512 // block_w)|block_m = max(1, 256 // block_w)|'
  [sites32]='s|block_m = max(1, 512 // block_w)|block_m = max(1, 1024 // block_w)|'
)
for name in base stream_nbr stream_nbr_keep_table sites8 sites32; do
  tree=/tmp/kmap-$name
  rm -rf "$tree" && mkdir -p "$tree" && cp -r insum benchmarks "$tree"/
  [ -n "${EDITS[$name]}" ] && sed -i "${EDITS[$name]}" "$tree/$F"
  changed=$(diff "$F" "$tree/$F" | grep -c '^>')
  echo "== $name ($changed lines changed)" | tee -a "$DIR/times.log"
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree INSUM_CACHE_DIR=/tmp/kmap-cache-$name timeout 120 \
    python -m benchmarks.explore.profile_kmap --sizes "$SIZES" --time-only 2>&1 | grep -v "^W1\|Warning\|warn" | tee -a "$DIR/times.log")
done
if command -v ncu >/dev/null; then
  timeout 150 ncu --kernel-name regex:hash_probe --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats python -c "
import torch
from benchmarks.study_conv import room_scene
from insum.nn.kernel_map import build_kernel_map
c = room_scene(${SIZES%%,*}, seed=0, device='cuda')
build_kernel_map(c); torch.cuda.synchronize()" > "$DIR/ncu_probe.log" 2>&1
  tail -90 "$DIR/ncu_probe.log"
fi
