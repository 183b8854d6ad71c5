"""The kernel suites under every build this CPU can execute, each forced with KT_KERNEL_CPU_VARIANT
in its own process; the AVX512 build with and without its AVX512_BF16, AVX512_VNNI and AVX512_VBMI paths
(AVX512_BF16 forced on where the build would measure fp32 FMA faster and take that), the AVX2 build
with and without its AVX-VNNI path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import HOST_FLAGS, REPO, skip_unless_cpu_runs

SUITES = [
    "tests/test_forward_bf16.py",
    "tests/test_mxfp4_kernels.py",
    "tests/test_int_kernels.py",
    "tests/test_fp8_kernels.py",
    "tests/test_accuracy.py",
    "tests/test_biases.py",
    "tests/test_mxfp8.py",
    "tests/test_nvfp4.py",
    "tests/test_gguf_kernels.py",
    "tests/test_gguf_accuracy.py",
]
RUNS = {
    "amx": {"KT_KERNEL_CPU_VARIANT": "amx"},
    "avx512-bf16-vnni": {"KT_KERNEL_CPU_VARIANT": "avx512", "KT_KERNEL_FORCE_AVX512_BF16": "1"},
    "avx512-plain": {
        "KT_KERNEL_CPU_VARIANT": "avx512",
        "KT_KERNEL_DISABLE_AVX512_BF16": "1",
        "KT_KERNEL_DISABLE_AVX512_VNNI": "1",
        "KT_KERNEL_DISABLE_AVX512_VBMI": "1",
    },
    "avx512-bf16-no-vbmi": {
        "KT_KERNEL_CPU_VARIANT": "avx512",
        "KT_KERNEL_FORCE_AVX512_BF16": "1",
        "KT_KERNEL_DISABLE_AVX512_VBMI": "1",
    },
    "avx512-fma-vbmi": {"KT_KERNEL_CPU_VARIANT": "avx512", "KT_KERNEL_DISABLE_AVX512_BF16": "1"},
    "avx2": {"KT_KERNEL_CPU_VARIANT": "avx2"},
    "avx2-plain": {"KT_KERNEL_CPU_VARIANT": "avx2", "KT_KERNEL_DISABLE_AVX_VNNI": "1"},
}
# Runs that change only some formats' paths run only those formats' suites (without AVX512_VBMI:
# FP8's arithmetic decoder, MXFP4's vpshufb lookup on vpdpbusd).
RUN_SUITES = {
    "avx512-bf16-no-vbmi": ["tests/test_fp8_kernels.py", "tests/test_mxfp4_kernels.py"],
    "avx512-fma-vbmi": ["tests/test_fp8_kernels.py"],
    "avx2-plain": [
        "tests/test_int_kernels.py",
        "tests/test_mxfp4_kernels.py",
        "tests/test_accuracy.py",
        "tests/test_gguf_kernels.py",
        "tests/test_gguf_accuracy.py",
    ],
}


@pytest.mark.parametrize("run", RUNS)
def test_kernel_suites_under_build(run):
    env = RUNS[run]
    skip_unless_cpu_runs(env["KT_KERNEL_CPU_VARIANT"])
    if run == "avx512-bf16-vnni" and not {"avx512_bf16", "avx512_vnni"} <= HOST_FLAGS:
        pytest.skip("this CPU lacks AVX512_BF16 or AVX512_VNNI: only the plain AVX512 paths can run")
    if run == "avx512-bf16-no-vbmi" and not {"avx512_bf16", "avx512vbmi"} <= HOST_FLAGS:
        pytest.skip("this CPU lacks AVX512_BF16 or AVX512_VBMI: the arithmetic FP8 decoder is its only one")
    if run == "avx2-plain" and "avx_vnni" not in HOST_FLAGS:
        pytest.skip("this CPU lacks AVX-VNNI: the avx2 run above is its plain integer path")
    if run == "avx512-fma-vbmi" and "avx512vbmi" not in HOST_FLAGS:
        pytest.skip("this CPU lacks AVX512_VBMI: avx512-plain runs its only FP8 path on fp32 FMA")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")} | env
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "error::RuntimeWarning",
        *RUN_SUITES.get(run, SUITES),
    ]
    result = subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary


def test_every_engine_format_has_accuracy_tests_in_the_suites_every_build_runs():
    """A format the engine compiles (src/core/formats/<name>.cpp) that the Python registry lacks, or
    an accuracy suite that stops taking its formats from the registry, fails here: the suites above
    run under every build, so a registered format they collect is tested on every build."""
    from kt_kernel import formats
    from kt_kernel._native import ext

    assert set(ext.FORMATS) == set(formats.FORMATS)
    suites = ["tests/test_accuracy.py", "tests/test_biases.py"]
    assert set(suites) <= set(SUITES)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *suites],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for suite in suites:
        for name in formats.FORMATS:
            ids = [line for line in result.stdout.splitlines() if line.startswith(suite) and name in line]
            assert any(f"[{name}" in line or f"-{name}]" in line or f"-{name}-" in line for line in ids), (
                f"{suite} collects no accuracy test of {name}"
            )
