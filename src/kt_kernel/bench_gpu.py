"""``python -m kt_kernel bench --gpu``: one layer's call with CUDA tensors on a CUDA stream next to the
same call with CPU tensors, and the overlap of GPU work queued between submit and sync."""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from . import bench_common


def _sleep_cycles_per_ms(torch) -> float:
    """GPU clock cycles torch.cuda._sleep spends per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _row(moe, stream, cpu_inputs, calls: int, cycles_per_ms: float) -> list[float]:
    """CPU-tensor ms, CUDA-tensor ms, GPU-busy ms, CUDA + busy ms, overlap of one layer's call."""
    import torch

    x, ids, weights = cpu_inputs
    x_gpu, ids_gpu, w_gpu = x.cuda(), ids.to(torch.int32).cuda(), weights.cuda()
    cpu_ms = _median_ms(functools.partial(moe.forward, x, ids, weights), calls)

    def on_gpu(busy_cycles: int = 0) -> None:
        moe.submit_forward(x_gpu, ids_gpu, w_gpu, stream.cuda_stream)
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)  # the GPU's own work of the layer
        moe.sync_forward(x_gpu, stream.cuda_stream)
        stream.synchronize()

    def busy_only(busy_cycles: int) -> None:
        torch.cuda._sleep(busy_cycles)
        stream.synchronize()

    gpu_ms = _median_ms(on_gpu, calls)
    busy = int(cpu_ms * cycles_per_ms)
    busy_ms = _median_ms(functools.partial(busy_only, busy), calls)
    both_ms = _median_ms(functools.partial(on_gpu, busy), calls)
    return [cpu_ms, gpu_ms, busy_ms, both_ms, (gpu_ms + busy_ms - both_ms) / min(gpu_ms, busy_ms)]


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("--gpu needs torch with a CUDA device")
        return 2
    from kt_kernel import KTMoEWrapper, __cpu_variant__

    stream = torch.cuda.current_stream()
    cycles_per_ms = _sleep_cycles_per_ms(torch)
    print(
        f"build {__cpu_variant__}, {args.threads} threads, {torch.cuda.get_device_name()}; medians of "
        f"{args.calls} calls; per call = submit + sync + the stream reaching the output"
    )
    print(
        "| shape | format | T | CPU tensors ms | CUDA tensors ms | +ms | GPU busy ms | CUDA + busy ms "
        "| overlap |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shape:
        experts, top_k, hidden, inter = bench_common.SHAPES[shape]
        gate, up, down = bench_common.random_weights(shape)
        for fmt in args.format:
            moe = KTMoEWrapper(
                0, experts, top_k, hidden, inter, None, args.threads, 1, None, 1024, method=fmt.upper()
            )
            moe.load_weights_from_tensors(gate, up, down)
            for tokens in args.tokens:
                inputs = bench_common.call_inputs(shape, tokens, 1)[0]
                cpu_ms, gpu_ms, busy_ms, both_ms, overlap = _row(
                    moe, stream, inputs, args.calls, cycles_per_ms
                )
                print(
                    f"| {shape} | {fmt} | {tokens} | {cpu_ms:.3f} | {gpu_ms:.3f} | {gpu_ms - cpu_ms:+.3f} | "
                    f"{busy_ms:.3f} | {both_ms:.3f} | {overlap:.0%} |"
                )
            moe.close()
    return 0
