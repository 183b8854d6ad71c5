"""One GEMM through a format's kernel on the calling thread (ext.linear: the kernels without the MoE
around them), weights of one expert projection (N = 768 outputs, K = 2048 inputs), for several
activation rows: median microseconds and GOP/s. Run it once per path to compare, e.g.

    KT_KERNEL_CPU_VARIANT=avx2 taskset -c 1 python bench/kernel_rates.py
    KT_KERNEL_CPU_VARIANT=avx2 KT_KERNEL_DISABLE_AVX_VNNI=1 taskset -c 1 python bench/kernel_rates.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kt_kernel
from kt_kernel import quant
from kt_kernel._native import ext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["INT8", "INT4", "MXFP4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 32, 128])
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args()
    print(f"build {kt_kernel.__cpu_variant__}: {kt_kernel.cpu_info()['kernels']}")
    weight = torch.randn(args.n, args.k, generator=torch.Generator().manual_seed(0)) / args.k**0.5
    for method in args.formats:
        values, scales = quant.quantize(method, weight)
        values = values if values.dtype == torch.bfloat16 else values.view(torch.uint8)
        scales = None if scales is None else scales.reshape(args.n, -1)
        for m in args.rows:
            x = torch.randn(m, args.k).to(torch.bfloat16).view(torch.int16)
            y = torch.empty(m, args.n)
            repeats = max(3, 2000 // m)
            seconds = statistics.median(ext.linear(method, x, values, scales, y, repeats) for _ in range(5))
            rate = 2 * m * args.k * args.n / seconds / 1e9
            print(f"{method:6} rows {m:4} {seconds * 1e6:9.1f} us {rate:7.1f} GOP/s")


if __name__ == "__main__":
    main()
