#!/usr/bin/env bash
# CI's sanitizer pass: the extension built with AddressSanitizer + UndefinedBehaviorSanitizer, and
# the engine-facing tests run against it. A memory error or undefined behaviour in the engine
# aborts the test process, so the pass fails. Run after ci/run_tests.sh (same environment).
set -euo pipefail
cd "$(dirname "$0")/.."

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The emulated-AMX module runs only on CPUs that run the avx512 build (its tests skip elsewhere), so
# it is built under the sanitizers only there: elsewhere it was 27 % of this pass's compile (job
# time in build/sanitize/.ninja_log, an AVX2-only CPU).
emulation=OFF
if python -c 'import sys; from pathlib import Path; from kt_kernel.loader import cpu_flags, missing_flags
sys.exit(1 if missing_flags("avx512", cpu_flags(Path("/proc/cpuinfo").read_text())) else 0)'; then
  emulation=ON
fi
python -m pip wheel -q --no-deps -C cmake.define.KT_KERNEL_SANITIZE=ON -C build-dir=build/sanitize \
  -C cmake.define.KT_KERNEL_AMX_EMULATION=$emulation -w "$out/dist" .
python -m pip install -q --no-deps --target "$out/site" "$out"/dist/kt_kernel-*.whl

# libasan must come first in the process, and libstdc++ be loaded before it starts (its exception
# interceptors look for it then; python itself does not link it). Python and torch leak by design
# at exit, so no leak check.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH="$out/site"
# Left out: the packaging tests (they build and install wheels of their own), the bench (full-size
# layers for minutes, and no engine code the other tests do not run) and the emulated-Haswell test
# (qemu cannot run the sanitizer runtime; it checks instructions, not memory).
python -m pytest tests -q -p no:cacheprovider --ignore=tests/test_packaging.py --ignore=tests/test_bench.py \
  --ignore=tests/test_emulated_haswell.py "$@"
