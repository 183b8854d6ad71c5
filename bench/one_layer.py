"""One MoE layer of a bench format (bench_common: ``gguf``, ``mxfp4``, ``gguf:q6_k`` ...), qwen3-30b's
H and I with 8 experts, every token routed to all 8, called CALLS times on one thread: a fixed
amount of kernel work for instruction counts, e.g.

    KT_KERNEL_CPU_VARIANT=avx2 valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect='*gemm_gguf*' python bench/one_layer.py gguf 8 2

Usage: one_layer.py FORMAT TOKENS CALLS [--time] (--time: also print ms per call, 3 x 200 calls)."""

import sys
import time

import torch

from kt_kernel import KTMoEWrapper
from kt_kernel.bench_common import load_bench_weights, method_of

EXPERTS, HIDDEN, INTER = 8, 2048, 768


def main() -> None:
    fmt, tokens, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.02 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02
    moe = KTMoEWrapper(
        layer_idx=0, num_experts=EXPERTS, num_experts_per_tok=EXPERTS, hidden_size=HIDDEN,
        moe_intermediate_size=INTER, gpu_experts_mask=None, cpuinfer_threads=1, threadpool_count=1,
        weight_path=None, chunked_prefill_size=512, method=method_of(fmt),
    )  # fmt: skip
    load_bench_weights(moe, fmt, gate, up, down)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    ids = torch.arange(EXPERTS).repeat(tokens, 1)
    weights = torch.full((tokens, EXPERTS), 1 / EXPERTS)
    for _ in range(calls):
        moe.forward(x, ids, weights)
    if "--time" in sys.argv:
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(200):
                moe.forward(x, ids, weights)
            print(f"{(time.perf_counter() - start) / 200 * 1e3:.3f} ms", end=" ")
        print()


if __name__ == "__main__":
    main()
