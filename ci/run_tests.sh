#!/usr/bin/env bash
# The test command of the README and of .ci/run: builds the wheel, installs it with its test extra,
# and runs the whole suite against the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch==2.13.0 is the local CPU build on this kind of machine; asking for it first keeps pip from
# resolving the unpinned `torch` requirement to a CUDA build.
python -m pip install -q torch==2.13.0

# qemu-user runs the emulated-Haswell test; objdump (binutils) the ISA purity test.
if ! command -v qemu-x86_64 >/dev/null || ! command -v objdump >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq qemu-user binutils >/dev/null || echo "warning: qemu-user/binutils not installed"
  fi
fi

rm -rf dist
# KT_KERNEL_AMX_EMULATION adds the test-only module that runs the AMX tile code on emulated tiles.
python -m pip wheel -q --no-deps -C cmake.define.KT_KERNEL_AMX_EMULATION=ON -w dist .
wheel=$(ls dist/kt_kernel-*.whl)
python -m pip install -q "${wheel}[test]"
python -m pip install -q --no-deps --force-reinstall "$wheel"  # over an earlier build of the same version
KT_KERNEL_WHEEL="$PWD/$wheel" python -m pytest tests -ra "$@"
