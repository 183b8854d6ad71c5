"""`python -m kt_kernel bench --model SHAPE`: a stack of layers, one build, in the worker process.

N layers of the shape called in turn as a model calls them (optionally with the cache cleared, a gap,
a co-runner or deferred experts between them), next to each weight set's layer called back to back in
the same run; and the table of those rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench_common import (
    DECODE_MAX_TOKENS,
    SHAPES,
    activations_label,
    bench_group,
    build_label,
    call_inputs,
    format_modes,
    format_of,
    gguf_bench_tensor,
    gguf_layout,
    opt,
    progress,
    random_weights,
    routing,
    time_calls,
    weight_bytes,
)


@dataclass
class ModelRow:
    variant: str
    shape: str
    format: str
    activations: str  # "exact", or "int8" for the opt-in int8_activations=True mode
    tokens: int
    layers: int
    weight_sets: int
    steps: int
    step_ms: float  # median over steps of the time inside the N layers (submit to end of sync)
    step_p10_ms: float
    step_p90_ms: float
    layer_ms: float  # step_ms / layers
    single_ms: float  # each weight set's layer called back to back: the median over the sets, same run
    ratio: float  # layer_ms / single_ms
    sync_ms: float  # per layer, median over steps: time the caller waits inside sync_forward
    layer_gbps: float  # distinct expert weights touched per layer / layer_ms
    dram_gbps: float | None  # DRAM read bandwidth measured just before a decode row
    pct_of_dram: float | None
    threads: int  # the process's threads once the N layers are built
    cache_clear_mib: int
    gap_ms: float
    co_runner: bool
    deferred: int | None


def weight_set_bytes(shape: str, fmt: str) -> float:
    experts, _, hidden, inter = SHAPES[shape]
    return experts * 3 * hidden * inter * weight_bytes(fmt)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def default_weight_sets(shape: str, fmt: str, layers: int) -> int:
    """As many weight sets as fit in a third of MemAvailable, at least 2 (consecutive layers must not
    share weights), at most one per layer."""
    fit = int(mem_available() / 3 // weight_set_bytes(shape, fmt))
    return min(layers, max(2, fit))


def canonical_weights(shape: str, fmt: str, seed: int) -> dict:
    """Random weights already in the format's canonical layout, as load_weights_from_tensors takes
    them: quantizing on load takes tens of seconds per qwen3-30b layer in int4, and the timing does
    not depend on the values. Random value bytes; every row gets the scales of one row of weights
    at the usual 1/sqrt(fan-in) scale quantized, so outputs stay at a sane magnitude all the same."""
    import torch

    f = format_of(fmt)
    if not f.scale_groups:  # the float weights are the format's values
        gate, up, down = random_weights(shape, seed)
        return {"gate_proj": gate, "up_proj": up, "down_proj": down}
    experts, _, hidden, inter = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, rows, k in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
        values = f.random_values((experts, rows, f.canonical_bytes(k)), gen)
        row = torch.empty(1, k).uniform_(-1, 1, generator=gen) * (3 / k) ** 0.5
        layout = gguf_layout(fmt, name)
        if layout is not None:  # values of the kind's range (4 bits: held as indices)
            low, high = layout.value_range
            values = torch.randint(low, high + 1, (experts, rows, k), generator=gen, dtype=torch.int8)
            _, scale = gguf_bench_tensor(row, layout)
        else:
            _, scale = f.quantize(row, bench_group(fmt, name))
        tensors[f"{name}_proj"] = values.view(f.value_dtypes[0])
        tensors[f"{name}_scale"] = scale.expand(experts, rows, *scale.shape[1:]).contiguous()
    return tensors


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def co_runner(enabled: bool) -> Iterator[None]:
    """A separate process spinning on one core meanwhile, as another program on the machine would."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def between_layers(cache_clear_mib: int, gap_ms: float) -> Callable[[], None]:
    """What runs before each layer call: a read of a separate buffer (attention and the dense layers
    evict the caches) and an idle gap."""
    import numpy as np

    # Filled, not zeros: untouched zero pages all map to one physical page, whose read stays in cache.
    buffer = np.ones(cache_clear_mib << 17, dtype=np.int64) if cache_clear_mib else None

    def between() -> None:
        if buffer is not None:
            buffer.sum()
        if gap_ms:
            time.sleep(gap_ms / 1e3)

    return between


def model_step(layers: list, x, routings: list, between: Callable[[], None]) -> tuple[float, float]:
    """One model step, each layer submitted then synced in turn: seconds inside the layers (submit to
    end of sync) and inside sync_forward alone, summed over the layers. `between` is not counted."""
    from kt_kernel import KTMoEWrapper

    inside = waiting = 0.0
    for i, (moe, (ids, weights)) in enumerate(zip(layers, routings, strict=True)):
        between()
        start = time.perf_counter()
        moe.submit_forward(x, ids, weights)
        submitted = time.perf_counter()
        moe.sync_forward(x)
        # Deferred experts go into the next call; where the weight sets wrap around (the next layer
        # has a lower layer_idx) and after the last layer, a model adds flush_deferred() instead.
        if i + 1 == len(layers) or layers[i + 1].layer_idx < moe.layer_idx:
            KTMoEWrapper.flush_deferred()
        end = time.perf_counter()
        inside += end - start
        waiting += end - submitted
    return inside, waiting


def time_steps(
    layers: list, shape: str, tokens: int, between: Callable[[], None], args: argparse.Namespace
) -> tuple[list[float], list[float], list[int]]:
    """Per timed step (after one warm-up step): seconds inside the layers and inside sync_forward;
    and the distinct experts of every layer call. Up to args.calls steps; after 3, stops once the
    steps used args.row_seconds. Fresh routing per layer per step, one hidden state per step."""
    import torch

    experts, top_k, hidden, _ = SHAPES[shape]
    rng = torch.Generator().manual_seed(0)
    inside: list[float] = []
    waiting: list[float] = []
    touched: list[int] = []
    for i in range(1 + args.calls):
        x = torch.randn(tokens, hidden, generator=rng).to(torch.bfloat16)
        routings = [routing(tokens, experts, top_k, rng) for _ in layers]
        step_s, sync_s = model_step(layers, x, routings, between)
        if i == 0:
            continue
        inside.append(step_s)
        waiting.append(sync_s)
        touched += [int(ids.unique().numel()) for ids, _ in routings]
        if len(inside) >= min(3, args.calls) and sum(inside) > args.row_seconds:
            break
    return inside, waiting, touched


def run_model_worker(args: argparse.Namespace) -> dict:
    """For each format: N wrappers (one per layer, so the process holds a model's threads), S of them
    loaded with distinct weights; layer i runs on loaded wrapper i mod S, so consecutive layers never
    share weights and, with S sets far beyond the L3, each layer reads its experts from DRAM."""
    import torch

    from kt_kernel import KTMoEWrapper
    from kt_kernel._native import ext

    torch.set_num_threads(args.threads)
    kernels = dict(ext.kernel_info())
    dram = ext.measure_read_bandwidth(args.threads, 1 << 29)
    label = build_label(kernels)
    shape = args.model
    experts, top_k, hidden, inter = SHAPES[shape]
    between = between_layers(args.cache_clear_mib, args.gap_ms)
    rows: list[ModelRow] = []
    runs = format_modes(args)
    steps_total, step = len(runs) * len(args.tokens), 0
    for fmt, mode in runs:
        name = activations_label(fmt, mode)
        progress(step, steps_total, f"{label} {shape} {name}: building {args.layers} layers")
        wrappers = [
            KTMoEWrapper(
                layer_idx=i, num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                moe_intermediate_size=inter, gpu_experts_mask=None, cpuinfer_threads=args.threads,
                threadpool_count=1, weight_path=None, chunked_prefill_size=512, method=format_of(fmt).name,
                max_deferred_experts_per_token=args.deferred, int8_activations=mode == "int8",
            )
            for i in range(args.layers)
        ]  # fmt: skip
        sets = args.weight_sets or default_weight_sets(shape, fmt, args.layers)
        weights = canonical_weights(shape, fmt, seed=0)
        for moe in wrappers[:sets]:  # the same values, each set in its own engine memory
            moe.load_weights_from_tensors(**weights)
        del weights
        threads = thread_count()
        layers = [wrappers[i % sets] for i in range(args.layers)]
        for tokens in args.tokens:
            progress(
                step, steps_total, f"{label} {shape} {name} T={tokens} ({args.layers} layers, {sets} sets)"
            )
            step += 1
            decode = tokens <= DECODE_MAX_TOKENS
            with co_runner(args.co_runner):
                # Bandwidth drifts on a shared machine: compare a decode row with a read just before it.
                row_dram = ext.measure_read_bandwidth(args.threads, 1 << 28, 3) if decode else None
                inside, waiting, touched = time_steps(layers, shape, tokens, between, args)
                # Each set's layer back to back, the median over the sets: the same work may read
                # slower from one set's memory than another's (docs/perf-log/, the model-stack notes).
                inputs, budget = call_inputs(shape, tokens, args.calls + 2), args.row_seconds / sets
                per_set = [
                    time_calls(moe.forward, inputs, budget, min(5, args.calls), args.calls, 1)
                    for moe in wrappers[:sets]
                ]
                single = statistics.median(statistics.median(times) for times in per_set)
                KTMoEWrapper.flush_deferred()  # the last call's, before the next row's token count
            median = statistics.median(inside)
            deciles = statistics.quantiles(inside, n=10) if len(inside) > 1 else [median] * 9
            layer_s = median / args.layers
            layer_gbps = statistics.mean(touched) * 3 * hidden * inter * weight_bytes(fmt) / layer_s / 1e9
            rows.append(
                ModelRow(
                    variant=label, shape=shape, format=fmt, activations=mode, tokens=tokens,
                    layers=args.layers, weight_sets=sets, steps=len(inside), step_ms=median * 1e3,
                    step_p10_ms=deciles[0] * 1e3, step_p90_ms=deciles[-1] * 1e3, layer_ms=layer_s * 1e3,
                    single_ms=single * 1e3, ratio=layer_s / single,
                    sync_ms=statistics.median(waiting) / args.layers * 1e3, layer_gbps=layer_gbps,
                    dram_gbps=row_dram, pct_of_dram=100 * layer_gbps / row_dram if row_dram else None,
                    threads=threads, cache_clear_mib=args.cache_clear_mib, gap_ms=args.gap_ms,
                    co_runner=args.co_runner, deferred=args.deferred,
                )
            )  # fmt: skip
        for moe in wrappers:
            moe.close()  # frees this format's weights before the next one's
        del wrappers, layers
    progress(steps_total, steps_total, "done\n")
    return {"variant": label, "dram_gbps": dram, "kernels": kernels, "model_rows": [asdict(r) for r in rows]}


def format_model_table(result: dict) -> str:
    m, model = result["machine"], result["model"]
    clear = f"{model['cache_clear_mib']} MiB read" if model["cache_clear_mib"] else "none"
    lines = [
        f"machine: {m['cpu']}, {m['threads']} threads",
        *(f"  {w['variant']:<12} DRAM read {w['dram_gbps']:.1f} GB/s" for w in result["workers"]),
        f"model: {model['layers']} layers of {model['shape']}; between layers: cache clearing {clear}, "
        f"gap {model['gap_ms']:g} ms; co-runner {'on' if model['co_runner'] else 'off'}; "
        f"deferred experts {model['deferred'] if model['deferred'] is not None else 'off'}",
    ]
    header = (
        f"{'build':<12} {'format':<9} {'T':>4} {'sets':>4} {'step ms':>9} {'p10-p90 ms':>17} {'layer ms':>9} "
        f"{'1-layer ms':>10} {'ratio':>6} {'sync ms':>8} {'GB/s':>6} {'DRAM':>5} {'%DRAM':>5} {'threads':>7}"
    )
    lines += ["", header, "-" * len(header)]

    for r in result["model_rows"]:
        lines.append(
            f"{r['variant']:<12} {activations_label(r['format'], r['activations']):<9} {r['tokens']:>4} "
            f"{r['weight_sets']:>4} "
            f"{r['step_ms']:>9.2f} {r['step_p10_ms']:>8.2f}-{r['step_p90_ms']:<8.2f} {r['layer_ms']:>9.3f} "
            f"{r['single_ms']:>10.3f} {r['ratio']:>6.2f} {r['sync_ms']:>8.3f} {r['layer_gbps']:>6.1f} "
            f"{opt(r['dram_gbps'], '5.1f'):>5} {opt(r['pct_of_dram'], '5.0f'):>5} {r['threads']:>7}"
        )
    lines.append(
        "\nstep ms: median over steps of the time inside the layers (submit_forward to the end of "
        "sync_forward, summed; clearing and gaps not counted); layer ms = step ms / layers.\n1-layer ms: "
        "each set's layer called back to back in the same run, the median over the sets; ratio = layer ms "
        "/ 1-layer ms.\nsync ms: per layer, the time the caller waits inside sync_forward.\nsets: distinct "
        "weight sets, cycled over the layers. "
        "GB/s: distinct expert weights touched per layer / layer ms; %DRAM (T <= 8) against DRAM, the read "
        "measured just before the row.\nthreads: the process's threads once the layers are built."
        "\n-i8act: the opt-in int8_activations=True mode (lossy on outlier activations)."
    )
    return "\n".join(lines)
