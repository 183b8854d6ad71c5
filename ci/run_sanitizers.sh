#!/usr/bin/env bash
# CI's sanitizer pass: the extension built with AddressSanitizer + UndefinedBehaviorSanitizer, and
# the engine-facing tests run against it. A memory error or undefined behaviour in the engine
# aborts the test process, so the pass fails. Run after ci/run_tests.sh (same environment).
set -euo pipefail
cd "$(dirname "$0")/.."

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m pip wheel -q --no-deps -C cmake.define.KT_KERNEL_SANITIZE=ON -C build-dir=build/sanitize \
  -C cmake.define.KT_KERNEL_AMX_EMULATION=ON -w "$out/dist" .
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
