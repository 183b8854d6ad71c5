#!/usr/bin/env bash
# The stream path on a real GPU, for a machine with a CUDA build of torch (not CI): builds and
# installs the package, runs tests/test_gpu.py (CUDA graphs replayed across live expert-placement
# updates among them), then the --gpu bench rows. Under 8 minutes on a
# 16-core machine. Logs go to $OUT (default /tmp/kt_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kt_gpu_check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# Two cores left free: one for CUDA's host-function thread, one for the Python thread (docs/serving.md).
threads="${KT_GPU_CHECK_THREADS:-$(( $(nproc) - 2 ))}"

python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import kt_kernel, torch; print('kt_kernel', kt_kernel.__cpu_variant__, '| torch', torch.__version__, \
'| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" | tee "$out/machine.log"
status=0
python3 -m pytest tests/test_gpu.py -v -ra 2>&1 | tee "$out/tests.log" || status=1
python3 -m kt_kernel bench --gpu --shape qwen3-30b --threads "$threads" --calls 30 2>&1 | tee "$out/bench.log" || status=1
exit $status
