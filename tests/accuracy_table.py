"""Prints the accuracy table of docs/formats.md for the build this process runs (KT_KERNEL_CPU_VARIANT and
KT_KERNEL_DISABLE_AVX512_* choose it): relative error against the fp64 reference on the stored
weights, qwen3-30b expert shape, 16 tokens, Gaussian activations and 4 channels x20 / x100.

    python tests/accuracy_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_accuracy import FORMATS, QWEN3, accuracy_case, wrapper_forward  # noqa: E402

import kt_kernel  # noqa: E402


def main() -> None:
    kernels = kt_kernel.cpu_info()["kernels"]
    print(f"build {kt_kernel.__cpu_variant__}: {kernels}")
    print("| activations mode | format | Gaussian | 4 channels x20 | 4 channels x100 |")
    print("|---|---|---|---|---|")
    for mode, options in (("default", {}), ("int8_activations=True", {"int8_activations": True})):
        for method in FORMATS:
            if method == "BF16" and options:
                continue  # BF16 multiplies bf16 activations: it has no int8 mode
            forward = wrapper_forward(method, QWEN3, **options)
            errors = [accuracy_case(forward, method, QWEN3, 16, outliers) for outliers in (0, 20, 100)]
            print(f"| {mode} | {method} | " + " | ".join(f"{100 * e:.3f} %" for e in errors) + " |")


if __name__ == "__main__":
    main()
