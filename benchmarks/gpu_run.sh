#!/usr/bin/env bash
# One device call: the CUDA correctness suite (generated kernels and formats), then the
# code-generator benchmarks and the demo (formats.auto against cuSPARSE on .data).
# Expects lark as a wheel in .whl/ and a copy of ../shared/data in .data/ (both git-ignored).
set -uo pipefail
pip install -q --no-index --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=/tmp/insum-cache
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python -m pytest -q -x -p no:cacheprovider tests/test_codegen.py tests/test_formats_kernels.py tests/test_formats.py tests/test_segment.py tests/test_auto.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15
fi
python -m benchmarks.codegen_h200 "$@" 2>&1 | tee "$OUT/bench.log"
python -m insum demo --data .data 2>&1 | tee "$OUT/demo.log" | grep -v Warning
