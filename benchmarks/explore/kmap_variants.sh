#!/usr/bin/env bash
# A/B of the hash probe kernel's memory hints and block size at 1.2M voxels (GPU, ~2 min):
# each variant is a copy of the tree with one edit of insum/nn/kernel_map.py, timed in its
# own process by profile_kmap --time-only; then ncu's memory sections of the base probe.
#   VARIANTS="base warp1_sites4" NCU="base warp1_sites4" bash benchmarks/explore/kmap_variants.sh [SIZES]
# (output under $OUT/kmap_variants/; default: the first five variants, ncu of base)
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
  # one or two warps a program: the probe loop's exit test is a warp's reduction, no barrier
  [warp1_sites4]='s|block_m = max(1, 512 // block_w)|block_m = max(1, 128 // block_w)|; s|^                BLOCK_M=block_m, BLOCK_W=block_w)$|                BLOCK_M=block_m, BLOCK_W=block_w, num_warps=1)|'
  [warp1_sites8]='s|block_m = max(1, 512 // block_w)|block_m = max(1, 256 // block_w)|; s|^                BLOCK_M=block_m, BLOCK_W=block_w)$|                BLOCK_M=block_m, BLOCK_W=block_w, num_warps=1)|'
  [warp2_sites8]='s|block_m = max(1, 512 // block_w)|block_m = max(1, 256 // block_w)|; s|^                BLOCK_M=block_m, BLOCK_W=block_w)$|                BLOCK_M=block_m, BLOCK_W=block_w, num_warps=2)|'
  # round 2 (after the probe's one-warp programs landed): the insert kernel, the pair groups
  [insert_warp1]='s|coords.stride(0), coords.stride(1), BLOCK=block)|coords.stride(0), coords.stride(1), BLOCK=block, num_warps=1)|'
  [insert_warp1_64]='s|coords.stride(0), coords.stride(1), BLOCK=block)|coords.stride(0), coords.stride(1), BLOCK=block, num_warps=1)|; s|        block = 128$|        block = 64|'
  [pairs_rows32]='s|block_m = max(1, 2048 // block_w)|block_m = max(1, 1024 // block_w)|'
  [pairs_warp8]='s|                BLOCK_P=1024)|                BLOCK_P=1024, num_warps=8)|'
  # round 4: the pairs kernel reads the map row-major (coalesced) and transposes in registers
  [pairs_coalesced]='s|        inp = tl.load(nbr_ptr + rows \* stride_nv + offs_w\[:, None\] \* stride_nw, mask=live, other=-1)|        inp = tl.trans(tl.load(nbr_ptr + tl.trans(rows) * stride_nv + offs_w[None, :] * stride_nw, mask=tl.trans(live), other=-1))|'
  # round 5 (after relaxed atomics): what the insert kernel's time is (the stats atomics left
  # out: timing only, the range check then reads nothing), and one-warp programs of 32 keys
  [insert_nostats]='/tl.atomic_m[a-z]*(stats_ptr\( + [12]\)\?, tl.m[a-z]*(tl.where(mask, /d'
  [probe_sites16]='s|        block_m = max(1, 256 // block_w)$|        block_m = max(1, 512 // block_w)|'
  # the probe's slots unsigned: a slot's address then needs no sign extension (IMAD.HI + IADD3.X
  # per element and round in the SASS of the signed one)
  [probe_uslot]='s/        slot = ((((mixed >> (65 - slot_bits)) \& ((1 << (slot_bits - 1)) - 1)) << 1) | (query \& 1)).to(tl.int32)/        slot = ((((mixed >> (65 - slot_bits)) \& ((1 << (slot_bits - 1)) - 1)) << 1) | (query \& 1)).to(tl.uint32)/'
  [insert_w1_32]='s|        block = 128$|        block = 32|; s|coords.stride(0), coords.stride(1), BLOCK=block)|coords.stride(0), coords.stride(1), BLOCK=block, num_warps=1)|'
  # round 3: a sparser table (4 or 8 slots a key, not 2): shorter longest probes in a warp
  [table4]='s|slot_bits = max(4, (2 \* n_in - 1).bit_length())|slot_bits = max(4, (4 * n_in - 1).bit_length())|'
  [table8]='s|slot_bits = max(4, (2 \* n_in - 1).bit_length())|slot_bits = max(4, (8 * n_in - 1).bit_length())|'
)
VARIANTS=${VARIANTS:-base stream_nbr stream_nbr_keep_table sites8 sites32}
for name in $VARIANTS; do
  tree=/tmp/kmap-$name
  rm -rf "$tree" && mkdir -p "$tree" && cp -r insum benchmarks "$tree"/
  [ -n "${EDITS[$name]}" ] && sed -i "${EDITS[$name]}" "$tree/$F"
  changed=$(diff "$F" "$tree/$F" | grep -c '^>')
  echo "== $name ($changed lines changed)" | tee -a "$DIR/times.log"
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree INSUM_CACHE_DIR=/tmp/kmap-cache-$name timeout 120 \
    python -m benchmarks.explore.profile_kmap --sizes "$SIZES" --time-only 2>&1 | grep -v "^W1\|Warning\|warn" | tee -a "$DIR/times.log")
  if [ -n "${PROFILE:-}" ]; then  # the build's kernels, profiled (each kernel's mean time)
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree INSUM_CACHE_DIR=/tmp/kmap-cache-$name timeout 120 \
      python -m benchmarks.explore.profile_kmap --sizes "${SIZES##*,}" 2>&1 > "$DIR/profile_$name.log"
     grep -m3 "hash_insert\|hash_probe\|^== insum build" "$DIR/profile_$name.log" | cut -c1-75,160-200 | tee -a "$DIR/times.log")
  fi
done
NCU=${NCU:-base}
if command -v ncu >/dev/null; then
  for name in $NCU; do
  (cd /tmp/kmap-$name && PYTHONPATH=/tmp/site:/tmp/kmap-$name timeout 100 ncu --kernel-name regex:hash_probe --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
    --section Occupancy --section WarpStateStats --section LaunchStats python -c "
import torch
from benchmarks.study_conv import room_scene
from insum.nn.kernel_map import build_kernel_map
c = room_scene(${SIZES%%,*}, seed=0, device='cuda')
build_kernel_map(c); torch.cuda.synchronize()" > "$DIR/ncu_probe_$name.log" 2>&1)
  grep -v "^ *-\+ \|^$" "$DIR/ncu_probe_$name.log" | grep -i "duration\|throughput\|executed ipc\|issue slots\|instructions\|registers\|occupancy\|warp cycles\|pipe\|stall" | head -40
  done
fi
cubin=$(find ~/.triton/cache /tmp -name 'insum_kernel_map_hash_probe.cubin' 2>/dev/null | head -1)
[ -n "$cubin" ] && cuobjdump -sass "$cubin" > "$DIR/hash_probe.sass" && echo "SASS: $(grep -c '^        /\*[0-9a-f]*\*/' "$DIR/hash_probe.sass") instructions in $cubin"
