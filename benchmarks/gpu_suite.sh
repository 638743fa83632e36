#!/usr/bin/env bash
# The one GPU driver: each part is one device call (under the 10-minute call limit).
#   bash benchmarks/gpu_suite.sh unstructured,costs     # studies, through python -m benchmarks
#   bash benchmarks/gpu_suite.sh structured,nm,fusion
#   bash benchmarks/gpu_suite.sh tests                  # the CUDA test suite, then codegen and the demo
#   bash benchmarks/gpu_suite.sh torch                  # torch_checks: opcheck, autograd, graphs, MLP
#   bash benchmarks/gpu_suite.sh reliability            # CUDA tests of the fuzzing fixes, gpu_fuzz, torch_checks' checks
#   bash benchmarks/gpu_suite.sh packing                # packing time and ops per format
#   bash benchmarks/gpu_suite.sh shapes                 # rectangular, odd and unaligned shapes (explore/shapes), N:M aligned rows
#   bash benchmarks/gpu_suite.sh cellfill               # CELL without a zero fill (< 90 s): CUDA tests, host time, device A/B
#   bash benchmarks/gpu_suite.sh gcfill                 # GroupCOO/COO without a zero fill (< 90 s): CUDA tests, host time, device A/B
#   bash benchmarks/gpu_suite.sh conv                   # SparseConv3d vs spconv-triton and the torch loop, kernel-map builds
#   bash benchmarks/gpu_suite.sh conv-spconv2           # the same against spconv 2.x (its CUDA wheels, carried as trees)
#   bash benchmarks/gpu_suite.sh kmap                   # kernel maps (< 90 s): the CUDA kernel-map tests, then the builds (hash table,
#                                                       #   sorted keys, torch ops) against spconv-triton's at 145k and 1.2M voxels
#   bash benchmarks/gpu_suite.sh layers                 # layer_overhead: ops/bytes per layer call, a profile of the conv layer
#   bash benchmarks/gpu_suite.sh schedule               # ownership, ranked tilings, declared lengths: A/B against the conventional plans
#   bash benchmarks/gpu_suite.sh tp                     # tensor products vs e3nn, cuEquivariance, OEQ
#   bash benchmarks/gpu_suite.sh tp-probe --L 1 --C 16,32  # FCTP layer (direct, gather) vs statement vs cuEquivariance
#   bash benchmarks/gpu_suite.sh distributed            # 2 GPUs (nvidia-h200-x2): NCCL tests, study_distributed
#   bash benchmarks/gpu_suite.sh lengths                # Block-ELL's declared lengths (< 90 s): CUDA tests, ncu of one product
# conv installs the spconv-triton wheel from .carry-conv-whl/ when carried; tp unpacks
# spconv 2.x from .carry-spconv2/*.tar.xz (spconv-cu121 2.3.8 and cumm-cu121 0.7.11 with
# their pure-Python dependencies, unpacked wheels recompressed to fit one call); tp unpacks
# cuEquivariance from .carry-tp-whl1/cue_all.tar.xz and puts OpenEquivariance's source from
# .carry-tp/oeq_src on the path when carried (third-party code: carried, never committed).
# Extra arguments go to the runner or script (e.g. --quick, --budget-scale 0.8). Needs lark as
# a wheel in .whl/ and a copy of ../shared/data in .data/ (carry both). Everything lands in
# $OUT/<device>/ (device from torch.cuda.get_device_name(): h200, h100, ...): logs, <study>.json
# and REPORT.md without plots. Copy that folder's files into benchmarks/results/<device>/ here
# and run `python -m benchmarks.report` for the merged report with plots.
pip install -q --no-index --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -uo pipefail
PART=${1:-unstructured,costs}
shift || true
export PYTHONUNBUFFERED=1 INSUM_CACHE_DIR=${INSUM_CACHE_DIR:-/tmp/insum-cache}
DEVICE=$(python -c "from benchmarks.common import device_name; print(device_name())")
DIR="${OUT:-/tmp/out}/$DEVICE"
mkdir -p "$DIR"
LOG="$DIR/suite-${PART//,/-}.log"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
  python -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$LOG"
# Dynamo/inductor warnings (lines starting W1121 ...) stay out of the logs.
quiet() { grep --line-buffered -v '^[WI][0-9]\{4\} '; }
case "$PART" in
  tests)
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
      python -m pytest -q -p no:cacheprovider tests/test_codegen.py tests/test_formats_kernels.py tests/test_formats.py \
        tests/test_tensorcore.py tests/test_reliability.py tests/test_nn.py tests/test_conv.py tests/test_tensor_product.py \
        tests/test_segment.py tests/test_auto.py tests/test_direct_launch.py tests/test_schedule.py tests/test_kernel_map.py \
        tests/test_structure.py tests/test_bind.py tests/test_stage.py tests/test_library.py \
        ${PYTEST_ARGS:-} 2>&1 | tee "$DIR/pytest_cuda.log" | tail -15
    fi
    python -m benchmarks.codegen "$@" 2>&1 | tee "$DIR/codegen.log"
    python -m benchmarks.host_time 2>&1 | tee "$DIR/host_time.log"
    python -m insum demo --data .data 2>&1 | tee "$DIR/demo.log" | grep -v Warning
    ;;
  reliability)
    # The CUDA tests of what the fuzzing fixes touch, random products and layer steps against
    # float64 (explore/gpu_fuzz), torch_checks' checks, and the insum_many race at its size.
    timeout 240 python -m pytest -q -p no:cacheprovider tests/test_reliability.py tests/test_nn.py tests/test_library.py \
      tests/test_formats.py tests/test_host_path.py tests/test_io.py ${PYTEST_ARGS:-} 2>&1 \
      | tee "$DIR/pytest_reliability.log" | tail -6
    timeout 150 python -m benchmarks.explore.gpu_fuzz --budget 120 --out "$DIR" 2>&1 | tail -6 | tee "$DIR/gpu_fuzz.log"
    timeout 150 python -m benchmarks.torch_checks --skip-bench 2>&1 | quiet | grep -E "PASS|FAIL|SKIP" \
      | tee "$DIR/torch_checks.log"
    ;;
  torch)
    timeout 560 python -m benchmarks.torch_checks --out "$DIR/torch_mlp.json" "$@" 2>&1 | quiet | tee "$DIR/torch_checks.log"
    ;;
  conv)
    [ -d .carry-conv-whl ] && pip install -q --no-index --no-deps --target /tmp/site .carry-conv-whl/*.whl
    timeout 560 python -m benchmarks.study_conv --out "$DIR" "$@" 2>&1 | quiet | tee "$DIR/conv.log"
    ;;
  kmap)
    [ -d .carry-conv-whl ] && pip install -q --no-index --no-deps --target /tmp/site .carry-conv-whl/*.whl
    timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_kernel_map.py -k "edge or duplicate or out_of_range \
      or budget or pair_groups or (lookups and dtype1 and (3-1-1-subm or 3-2-1-strided or 3-2-1-transposed))" 2>&1 \
      | tee "$DIR/pytest_kmap.log" | tail -5
    CONV_BUDGET_S=50 timeout 55 python -m benchmarks.study_conv --parts maps --sizes 120000,1000000 --out "$DIR" "$@" 2>&1 \
      | quiet | tee "$DIR/conv_maps.log"
    ;;
  conv-spconv2)
    mkdir -p /tmp/site2 && for t in .carry-spconv2/*.tar.xz; do tar xJf "$t" -C /tmp/site2; done
    CONV_ANCHOR=spconv PYTHONPATH=$PYTHONPATH:/tmp/site2 timeout 560 python -m benchmarks.study_conv --out "$DIR/spconv2" "$@" 2>&1 | quiet | tee "$DIR/conv_spconv2.log"
    ;;
  layers)
    timeout 560 python -m benchmarks.layer_overhead --profile --out "$DIR" "$@" 2>&1 | quiet | tee "$DIR/layer_overhead.log"
    ;;
  schedule)
    timeout 560 python -m benchmarks.explore.schedule --out "$DIR/schedule_ab.json" "$@" 2>&1 | quiet | tee "$DIR/schedule_ab.log"
    ;;
  tp)
    [ -f .carry-tp-whl1/cue_all.tar.xz ] && tar xJf .carry-tp-whl1/cue_all.tar.xz -C /tmp/site
    [ -d .carry-tp/oeq_src ] && export PYTHONPATH=$PYTHONPATH:$PWD/.carry-tp/oeq_src
    timeout 560 python -m benchmarks.study_tensor_product --out "$DIR" "$@" 2>&1 | quiet | tee "$DIR/tensor_product.log"
    ;;
  tp-probe)
    [ -f .carry-tp-whl1/cue_all.tar.xz ] && tar xJf .carry-tp-whl1/cue_all.tar.xz -C /tmp/site
    timeout 90 python -m benchmarks.explore.layer_probe "$@" 2>&1 | quiet | tee "$DIR/tp_probe.log"
    ;;
  distributed)
    timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py 2>&1 | tail -5 | tee "$DIR/pytest_distributed_cuda.log"
    OUT="$DIR" timeout 400 torchrun --standalone --nproc_per_node=2 -m benchmarks.study_distributed "$@" 2>&1 | quiet | tee "$DIR/study_distributed_x2.log"
    ;;
  lengths)
    timeout 60 python -m pytest -q -p no:cacheprovider tests/test_formats_kernels.py tests/test_nn.py \
      -k "block_ell or BlockELL or compiled" 2>&1 | tee "$DIR/pytest_lengths.log" | tail -3
    for b in 32 64; do
      timeout 40 python -m benchmarks.explore.block_ncu --block $b 2>&1 | tee -a "$DIR/block_ncu.log"
      command -v ncu >/dev/null && timeout 60 ncu --clock-control none --kernel-name regex:insum --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis python -m benchmarks.explore.block_ncu --block $b 2>&1 \
        | grep -i "duration\|throughput\|l2 \|hit rate\|dram\|bandwidth\|block_ncu\|b$b" | head -30 | tee -a "$DIR/block_ncu.log"
    done
    ;;
  packing)
    timeout 560 python -m benchmarks.packing "$@" 2>&1 | quiet | tee "$DIR/packing.log"
    ;;
  shapes)
    # Shapes the suites do not time (explore/shapes): the N:M aligned-rows tests, then the parts
    # (default block,nm,strides,padding; pass e.g. --only layer,channels for others).
    timeout 60 python -m pytest -q -p no:cacheprovider tests/test_aligned_rows.py 2>&1 | tee "$DIR/pytest_shapes.log" | tail -3
    timeout 480 python -m benchmarks.explore.shapes --out "$DIR" --budget 420 ${@:---only block,nm,strides,padding} 2>&1 \
      | quiet | grep -v -i "warn" | tee "$DIR/shapes.log"
    ;;
  cellfill)
    # CELL's covering layout (< 90 s): its CUDA tests (the covering product; pinned and direct products of every
    # format, whose GroupCOO/COO `=` segment kernels take the exact ownership), host time of every row (CELL and
    # CELL cover=False side by side, with the launch paths; first tiles, not tuned: host time does not depend on
    # them), then both layouts' device and host time on the host-time matrix and the largest covering DLMC matrix.
    timeout 40 python -m pytest -q -p no:cacheprovider -m gpu tests/test_cell_covering.py tests/test_direct_launch.py \
      -k "covering or cuda_pinned or cuda_cell" 2>&1 | tee "$DIR/pytest_cellfill.log" | tail -5
    INSUM_AUTOTUNE=0 timeout 25 python -m benchmarks.host_time --calls 1000 --repeats 5 --label "INSUM_AUTOTUNE=0" 2>&1 \
      | tee "$DIR/host_time_cellfill.log"
    INSUM_AUTOTUNE=0 timeout 22 python -m benchmarks.explore.cell_cover --files 1 --dtypes fp32 --data .data 2>&1 \
      | tee "$DIR/cell_cover.log"
    ;;
  gcfill)
    # GroupCOO's and COO's covering layout (< 90 s): the covering tests on CUDA (the interpreter tests run compiled:
    # poisoned pinned output, fallbacks, SparseLinear), host time of every row (GroupCOO/COO short rows, covering
    # and cover=False, beside the bare launch; first tiles), then both layouts' device and host time on the
    # short-rows matrix, the largest covering DLMC matrix, a power-law graph (hub rows: no cover) and a uniform one.
    INSUM_AUTOTUNE=0 timeout 35 python -m pytest -q -p no:cacheprovider tests/test_groupcoo_covering.py 2>&1 \
      | tee "$DIR/pytest_gcfill.log" | tail -5
    INSUM_AUTOTUNE=0 timeout 20 python -m benchmarks.host_time --calls 1000 --repeats 5 --label "INSUM_AUTOTUNE=0" 2>&1 \
      | tee "$DIR/host_time_gcfill.log"
    INSUM_AUTOTUNE=0 timeout 30 python -m benchmarks.explore.groupcoo_cover --files 1 --dtypes fp32 --data .data 2>&1 \
      | tee "$DIR/groupcoo_cover.log"
    ;;
  *)
    timeout 520 python -m benchmarks --studies "$PART" --data .data --out "benchmarks/results/$DEVICE" --copy-to "$DIR" \
      --deadline 470 --no-report "$@" 2>&1 | quiet | tee -a "$LOG"
    echo "runner exit status ${PIPESTATUS[0]}" | tee -a "$LOG"
    python -m benchmarks.report --results "benchmarks/results/$DEVICE" --out "$DIR" --no-plots 2>&1 | tee -a "$LOG"
    ;;
esac
