#!/usr/bin/env bash
# A/B of the kernel-map build: this tree against a base tree (the package as of an earlier
# commit: `git archive <commit> insum benchmarks | tar -x -C DIR`), each timed in its own
# process by profile_kmap --time-only (spconv-triton's build beside it when installed),
# alternated for ROUNDS rounds so that the host's drift falls on both; then the profiler's
# kernel table of this tree.
#   BASE=.carry-kmap-base bash benchmarks/explore/kmap_ab.sh [SIZES] [ROUNDS]    (GPU, ~2 min)
set -uo pipefail
SIZES=${1:-120000,1000000}
ROUNDS=${2:-2}
BASE=${BASE:?the base tree (a directory holding insum/ and benchmarks/)}
DIR="${OUT:-/tmp/out}/kmap_ab"
mkdir -p "$DIR"
for round in $(seq "$ROUNDS"); do
  for side in base new; do
    tree=$PWD; [ "$side" = base ] && tree=$(cd "$BASE" && pwd)
    echo "== $side, round $round" | tee -a "$DIR/times.log"
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree INSUM_CACHE_DIR=/tmp/kmap-ab-cache-$side timeout 150 \
      python -m benchmarks.explore.profile_kmap --sizes "$SIZES" --time-only 2>&1 | grep -v "Warning\|warn" \
      | tee -a "$DIR/times.log")
  done
done
timeout 150 python -m benchmarks.explore.profile_kmap --sizes "${SIZES##*,}" > "$DIR/profile_new.log" 2>&1
grep "^== \|kernel_map\|sort\|Memset\|copy_\|fill_" "$DIR/profile_new.log" | cut -c1-60,150-200 | head -60
