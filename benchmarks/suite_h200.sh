#!/usr/bin/env bash
# The benchmark suite on the H200, some studies per device call (each call < 9 minutes):
#   bash benchmarks/suite_h200.sh unstructured,costs
#   bash benchmarks/suite_h200.sh structured,nm,fusion
# Extra arguments go to the runner (e.g. --quick, --budget-scale 0.8). Needs lark as a wheel
# in .whl/ and a copy of ../shared/data in .data/ (carry both). Writes <study>.json, the log
# and REPORT.md (no plots) under $OUT; copy the JSON files into benchmarks/results/ here and
# run `python -m benchmarks.report` for the merged report with plots.
pip install -q --no-index --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -uo pipefail
STUDIES=${1:-unstructured,costs}
shift || true
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=${INSUM_CACHE_DIR:-/tmp/insum-cache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/suite-${STUDIES//,/-}.log"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
  python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
# Dynamo/inductor warnings (lines starting W1121 ...) stay out of the log.
timeout 520 python -m benchmarks --studies "$STUDIES" --data .data --out benchmarks/results --copy-to "$OUT" \
  --deadline 470 --no-report "$@" 2>&1 | grep --line-buffered -v '^[WI][0-9]\{4\} ' | tee -a "$LOG"
echo "runner exit status ${PIPESTATUS[0]}" | tee -a "$LOG"
python -m benchmarks.report --results benchmarks/results --out "$OUT" --no-plots 2>&1 | tee -a "$LOG"
