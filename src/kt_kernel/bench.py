"""`python -m kt_kernel bench`: the standard MoE workload (docs/performance.md) through KTMoEWrapper.

Each build runs in its own subprocess (KT_KERNEL_CPU_VARIANT forces it). A worker measures the machine
(DRAM read bandwidth, peak multiply-add rates) with the same threads, then times every row: random
weights quantized on load, routing drawn afresh for every call (seed 0), and the same calls in plain
PyTorch side by side: per-expert F.linear in bf16 for bf16 and mxfp4 (torch has no MXFP4 kernel),
torch._weight_int8pack_mm / torch._weight_int4pack_mm_for_cpu on the same quantized weights for int8
and int4.

`--model SHAPE` times a stack of layers instead (bench_model.py); `--guard` is CI's check against torch
(bench_guard.py), `--gpu` the stream path with CUDA tensors (bench_gpu.py), `--load` load_weights()
from each checkpoint format (bench_load.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from . import formats
from .bench_common import (
    DECODE_MAX_TOKENS,
    NVFP4_ENTRY,
    SHAPES,
    activations_label,
    build_label,
    call_inputs,
    format_modes,
    format_of,
    load_bench_weights,
    method_of,
    opt,
    progress,
    random_weights,
    run_workers,
    time_calls,
    usage_error,
    variant_runs,
)
from .gguf_blocks import BLOCK_TYPES

DEFAULT_SHAPES = ("qwen3-30b", "dsv3-32e")
TOKENS = (1, 8, 64, 512)
MODEL_TOKENS = (1, 8, 512)
MODEL_LAYERS = 48  # Qwen3-30B-A3B's MoE layers


@dataclass
class Row:
    variant: str
    shape: str
    format: str
    activations: str  # "exact", or "int8" for the opt-in int8_activations=True mode
    tokens: int
    calls: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float
    held_bytes_per_weight: float  # the engine's packed bytes over the layer's weights, scales included
    gbps: float
    tflops: float
    dram_gbps: float | None  # DRAM read bandwidth measured just before a decode row
    pct_of_bandwidth: float | None
    pct_of_peak: float | None
    peak_op: str
    torch_median_ms: float | None
    speedup_vs_torch: float | None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------------------------
# Worker: one build, in this process.
# ---------------------------------------------------------------------------------------------
def torch_moe(x, ids, weights, linear, gate, up, down):
    """Plain PyTorch of one call: linear(x, weight) per expert and projection."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in ids.unique().tolist():
        token, k = (ids == expert).nonzero(as_tuple=True)
        xt = x[token]
        act = F.silu(linear(xt, gate[expert])) * linear(xt, up[expert])
        out.index_add_(0, token, linear(act, down[expert]).float() * weights[token, k, None])
    return out.to(torch.bfloat16)


def _torch_bf16(gate, up, down):
    import torch.nn.functional as F

    return F.linear, gate, up, down


def _torch_int8(gate, up, down):
    import torch

    def int8_weights(w):
        q, s = formats.INT8.quantize(w)
        return q, s.to(torch.bfloat16)

    def int8_linear(x, w):
        return torch._weight_int8pack_mm(x, *w)

    return (int8_linear, *([int8_weights(e) for e in proj] for proj in (gate, up, down)))


def _torch_int4(gate, up, down):
    import torch

    group = max(formats.INT4.scale_groups)  # the group quantize-on-load picks for every shape here

    def int4_weights(w):  # torch's int4 is unsigned with w = (q - 8) * scale + zero
        values, scales = formats.INT4.quantize(w, group_size=group)
        q = formats.INT4.dequantize(values, torch.ones_like(scales)).round().to(torch.int32) + 8
        scale_zero = torch.stack([scales.T, torch.zeros_like(scales.T)], dim=-1).to(torch.bfloat16)
        return torch._convert_weight_to_int4pack_for_cpu(q, 2), scale_zero.contiguous()

    def int4_linear(x, w):
        return torch._weight_int4pack_mm_for_cpu(x, w[0], group, w[1])

    return (int4_linear, *([int4_weights(e) for e in proj] for proj in (gate, up, down)))


#: PyTorch's own call per format, (linear, gate, up, down) with weights in torch's layout.
TORCH_BASELINES = {"bf16": _torch_bf16, "int8": _torch_int8, "int4": _torch_int4}


def torch_format(fmt: str) -> str:
    """The PyTorch baseline of a format: itself where torch has a kernel for it, else bf16 (MXFP4)."""
    return fmt if fmt in TORCH_BASELINES else "bf16"


def bench_format(text: str) -> str:
    """--format's entries: a format's name, ``name:G`` for a format that offers a choice of group
    size (``fp8:16`` runs NVFP4's blocks, ``fp8:32`` MXFP8's), ``gguf:TYPE`` (a ggml type), or
    ``nvfp4`` (method NVFP4 on weights quantized as ModelOpt does: held as GGUF)."""
    if text.lower() == NVFP4_ENTRY:
        return NVFP4_ENTRY
    name, _, group = text.lower().partition(":")
    choices = [f.lower() for f in formats.FORMATS]
    if name not in choices:
        raise argparse.ArgumentTypeError(f"{text!r}: not one of {', '.join(choices)} (or name:G)")
    if formats.get(name) is formats.GGUF and group.upper() in BLOCK_TYPES:
        return text.lower()
    if group:
        f = formats.get(name)
        if not f.group_choice or not group.isdigit() or int(group) not in f.scale_groups or not int(group):
            offered = ", ".join(
                f"{n.lower()}:{g}" for n in formats.GROUP_CHOICE for g in formats.get(n).scale_groups if g
            )
            raise argparse.ArgumentTypeError(f"{text!r}: the groups offered are {offered}")
    return text.lower()


def run_worker(args: argparse.Namespace) -> dict:
    import torch

    from kt_kernel import KTMoEWrapper
    from kt_kernel._native import ext

    torch.set_num_threads(args.threads)
    kernels = dict(ext.kernel_info())
    peak_probes = ("fma_f32", "dpbf16", "dpint8", "tile_bf16")
    peak = {op: ext.measure_peak_gflops(args.threads, op) for op in peak_probes}
    dram = ext.measure_read_bandwidth(args.threads, 1 << 29)
    uses_dpbf16 = "vdpbf16ps" in kernels["bf16_path"]
    uses_dpint8 = "vpdpbusd" in kernels["int8_path"]
    # The peak each format's kernel is measured against: its multiply instruction, fp32 FMA where it
    # has none of its own (the yardstick for the AVX2 build). Formats that quantize activations
    # multiply int8, the others bf16.
    bf16_op, int8_op = "dpbf16" if uses_dpbf16 else "fma_f32", "dpint8" if uses_dpint8 else "fma_f32"
    peak_ops = {f: int8_op if format_of(f).quantized_activations else bf16_op for f in args.format}
    if peak["tile_bf16"]:  # the amx build on AMX hardware: every format's prefill against AMX-BF16
        peak_ops = dict.fromkeys(args.format, "tile_bf16")
    label = build_label(kernels)
    rows: list[Row] = []
    baselines = sorted({torch_format(f) for f in args.format}) if args.torch else []
    runs = format_modes(args)
    steps = len(args.shape) * (len(runs) + len(baselines)) * len(args.tokens)
    step = 0
    for shape in args.shape:
        experts, top_k, hidden, inter = SHAPES[shape]
        gate, up, down = random_weights(shape)
        shape_rows: list[Row] = []
        for fmt, mode in runs:
            moe = KTMoEWrapper(
                layer_idx=0, num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                moe_intermediate_size=inter, gpu_experts_mask=None, cpuinfer_threads=args.threads,
                threadpool_count=1, weight_path=None, chunked_prefill_size=512, method=method_of(fmt),
                int8_activations=mode == "int8",
            )  # fmt: skip
            load_bench_weights(moe, fmt, gate, up, down)
            held = sum(sp.engine.packed_bytes() for sp in moe._subpools) / (experts * 3 * hidden * inter)
            for tokens in args.tokens:
                progress(step, steps, f"{label} {shape} {fmt} ({mode} activations) T={tokens}")
                step += 1
                inputs = call_inputs(shape, tokens, args.calls + 2)  # fresh routing for every call
                decode = tokens <= DECODE_MAX_TOKENS
                # Bandwidth drifts on a shared machine: compare a decode row with a read just before it.
                row_dram = ext.measure_read_bandwidth(args.threads, 1 << 28, 3) if decode else None
                times = time_calls(
                    moe.forward, inputs, args.row_seconds, min(5, args.calls), args.calls, warmup=1
                )
                touched = statistics.mean(int(ids.unique().numel()) for _, ids, _ in inputs)
                median = statistics.median(times)
                deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [median] * 9
                gbps = touched * 3 * hidden * inter * held / median / 1e9
                tflops = 2 * 3 * hidden * inter * tokens * top_k / median / 1e12
                shape_rows.append(
                    Row(
                        variant=label, shape=shape, format=fmt, activations=mode, tokens=tokens,
                        calls=len(times),
                        median_ms=median * 1e3, p10_ms=deciles[0] * 1e3, p90_ms=deciles[-1] * 1e3,
                        tokens_per_s=tokens / median, held_bytes_per_weight=held, gbps=gbps, tflops=tflops,
                        dram_gbps=row_dram, pct_of_bandwidth=100 * gbps / row_dram if decode else None,
                        pct_of_peak=None if decode else 100 * tflops * 1e3 / peak[peak_ops[fmt]],
                        peak_op=peak_ops[fmt], torch_median_ms=None, speedup_vs_torch=None,
                    )
                )  # fmt: skip
            del moe
        # PyTorch after the engine's rows (its OpenMP threads keep spinning after each call and would
        # take cores from the engine), once per token count and torch format: the same calls.
        for baseline_format in baselines:
            linear, *weights = TORCH_BASELINES[baseline_format](gate, up, down)
            baseline = partial(torch_moe, linear=linear, gate=weights[0], up=weights[1], down=weights[2])
            for tokens in args.tokens:
                progress(step, steps, f"{label} {shape} torch {baseline_format} T={tokens}")
                step += 1
                inputs = call_inputs(shape, tokens, args.calls + 2)
                median = statistics.median(
                    time_calls(baseline, inputs, args.row_seconds, min(5, args.calls), args.calls, warmup=1)
                )
                for row in shape_rows:
                    if row.tokens == tokens and baseline_format == torch_format(row.format):
                        row.torch_median_ms, row.speedup_vs_torch = median * 1e3, median * 1e3 / row.median_ms
            del baseline, weights
        rows += shape_rows
    progress(steps, steps, "done\n")
    return {"variant": label, "dram_gbps": dram, "peak_gflops": peak, "kernels": kernels,
            "rows": [asdict(r) for r in rows]}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Parent: the command line, one subprocess per build (bench_common.run_workers), then the table.
# ---------------------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"machine: {m['cpu']}, {m['threads']} threads"]
    for w in result["workers"]:
        peaks = ", ".join(f"{op} {g:.0f} G/s" for op, g in w["peak_gflops"].items() if g)  # FLOP or int OP
        lines.append(f"  {w['variant']:<12} DRAM read {w['dram_gbps']:.1f} GB/s; peak {peaks}")
    header = (
        f"{'build':<12} {'shape':<10} {'format':<9} {'T':>4} {'median ms':>10} {'p10-p90 ms':>15} "
        f"{'tok/s':>9} {'B/w':>5} {'GB/s':>6} {'DRAM':>5} {'%BW':>5} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'torch ms':>9} {'speedup':>7}"
    )
    lines += ["", header, "-" * len(header)]

    for r in result["rows"]:
        lines.append(
            f"{r['variant']:<12} {r['shape']:<10} "
            f"{activations_label(r['format'], r['activations']):<9} "
            f"{r['tokens']:>4} {r['median_ms']:>10.2f} "
            f"{r['p10_ms']:>7.2f}-{r['p90_ms']:<7.2f} {r['tokens_per_s']:>9.1f} "
            f"{r['held_bytes_per_weight']:>5.3f} {r['gbps']:>6.1f} "
            f"{opt(r['dram_gbps'], '5.1f'):>5} {opt(r['pct_of_bandwidth'], '5.0f'):>5} {r['tflops']:>8.3f} "
            f"{opt(r['pct_of_peak'], '6.0f'):>6} "
            f"{opt(r['torch_median_ms'], '9.2f'):>9} {opt(r['speedup_vs_torch'], '6.2f'):>6}x"
        )
    lines.append(
        "\nB/w: bytes the engine holds per weight, scales included (packed_bytes() over the weights). "
        "GB/s: the distinct experts' held bytes / latency."
        "\n%BW (T <= 8): effective bandwidth (distinct expert weights touched / latency) vs DRAM, the read "
        "bandwidth measured just before the row.\n%peak (T >= 64): vs the measured peak of the instruction "
        "the kernel uses (vdpbf16ps, vpdpbusd, or fp32 FMA where it uses neither; on AMX hardware, AMX-BF16 "
        "tdpbf16ps for every format).\ntorch: per-expert "
        "F.linear in bf16 (bf16, mxfp4), torch._weight_int8pack_mm (int8), _weight_int4pack_mm_for_cpu "
        "(int4); with a build forced (--variant), torch is held to that build's instruction set (oneDNN's "
        "ONEDNN_MAX_CPU_ISA, ATen's ATEN_CPU_CAPABILITY)."
        "\n-i8act: the opt-in int8_activations=True mode (lossy on outlier activations)."
    )
    return "\n".join(lines)


def positive_int(text: str) -> int:
    return _bounded(int, text, 1)


def non_negative_int(text: str) -> int:
    return _bounded(int, text, 0)


def non_negative_float(text: str) -> float:
    return _bounded(float, text, 0)


def _bounded(kind: type, text: str, minimum: float):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    choices = [name.lower() for name in formats.FORMATS]
    parser.add_argument(
        "--shape", nargs="+", choices=list(SHAPES), help=f"default: {' '.join(DEFAULT_SHAPES)}"
    )
    parser.add_argument(
        "--format", nargs="+", type=bench_format, default=choices, metavar="FORMAT",
        help=f"{', '.join(choices)}, or name:G for scale groups of G ({', '.join(formats.GROUP_CHOICE)}; "
        "fp8:16: NVFP4's blocks held as FP8, fp8:32: MXFP8's; nvfp4: method NVFP4, held as GGUF; "
        "gguf alone: Q4_K_M's mix; gguf:TYPE: a ggml type's kind, "
        "e.g. gguf:q6_k)",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", nargs="+", type=int,
        help=f"default: {' '.join(map(str, TOKENS))} ({' '.join(map(str, MODEL_TOKENS))} with --model)",
    )  # fmt: skip
    parser.add_argument(
        "--variant",
        default="auto",
        help="auto (the build import picks), all (every build this CPU runs, and its plain runs), or a "
        "comma list of amx, avx512, avx512-plain (AVX512 without its BF16 and VNNI paths), avx2, "
        "avx2-plain (AVX2 without AVX-VNNI)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--calls",
        type=int,
        default=20,
        help="timed calls per row (fewer for slow rows); --model: timed steps",
    )
    parser.add_argument(
        "--row-seconds", type=float, default=5.0, help="after 5 calls, stop a row once it used this long"
    )
    parser.add_argument(
        "--activations", nargs="+", choices=["exact", "int8"], default=["exact"],
        help="exact (the default mode) and/or int8 (int8_activations=True): both print side by side",
    )  # fmt: skip
    parser.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch baseline")
    parser.add_argument(
        "--quick", action="store_true", help="qwen3-30b, T=1 and 64, 10 calls: under a minute"
    )
    parser.add_argument("--json", metavar="FILE", help="write every figure and the machine info as JSON")
    parser.add_argument(
        "--gpu", action="store_true",
        help="time calls with CUDA tensors on a CUDA stream next to CPU tensors (needs torch with CUDA)",
    )  # fmt: skip
    parser.add_argument(
        "--guard", action="store_true",
        help="CI's guard: prefill rows of every format on every build this CPU runs beside torch; exit "
        "status 1 when one is slower than torch twice (default qwen3-30b, T=512)",
    )  # fmt: skip
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    model = parser.add_argument_group(
        "model mode", "a stack of layers of one shape, called in turn as a model does (docs/performance.md)"
    )
    model.add_argument("--model", choices=list(SHAPES), metavar="SHAPE", help="time a stack of this shape")
    model.add_argument("--layers", type=positive_int, help=f"layers in the stack (default {MODEL_LAYERS})")
    model.add_argument(
        "--weight-sets", type=positive_int, metavar="S",
        help="distinct weight sets cycled over the layers (default: as many as fit in a third of "
        "MemAvailable, at least 2, at most --layers)",
    )  # fmt: skip
    model.add_argument(
        "--cache-clear-mib", type=non_negative_int, default=0, metavar="M",
        help="read M MiB of another buffer between layer calls, as attention and dense layers would",
    )  # fmt: skip
    model.add_argument(
        "--gap-ms", type=non_negative_float, default=0.0, metavar="G", help="sleep G ms between layer calls"
    )
    model.add_argument(
        "--co-runner", action="store_true", help="a separate process spins on one core during each row"
    )
    model.add_argument(
        "--deferred", type=non_negative_int, metavar="D",
        help="pass max_deferred_experts_per_token=D to every layer",
    )  # fmt: skip
    from . import bench_load

    bench_load.add_arguments(parser)


def check_model_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the model-mode options (None: nothing), defaults filled in."""
    given = [
        flag for flag, value in (("--layers", args.layers), ("--weight-sets", args.weight_sets),
                                 ("--cache-clear-mib", args.cache_clear_mib), ("--gap-ms", args.gap_ms),
                                 ("--co-runner", args.co_runner), ("--deferred", args.deferred))
        if value
    ]  # fmt: skip
    if not args.model:
        return f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --model" if given else None
    if args.shape:
        return "--model names the shape: drop --shape"
    if args.quick:
        return "--quick is for the single-layer bench: drop it with --model"
    args.layers = args.layers or MODEL_LAYERS
    if args.weight_sets and args.weight_sets > args.layers:
        return f"--weight-sets {args.weight_sets} exceeds --layers {args.layers}"
    if args.weight_sets == 1 and args.layers > 1:
        return "--weight-sets 1: consecutive layers would share weights (read from cache): use 2 or more"
    return None


def main(args: argparse.Namespace) -> int:
    problem = check_model_arguments(args)
    if problem:
        return usage_error(problem)
    if args.load is not None:
        from . import bench_load

        return bench_load.main(args, SHAPES)
    if args.quick:
        args.shape, args.tokens, args.calls = ["qwen3-30b"], [1, 64], 10
    if args.guard:
        from . import bench_guard

        return bench_guard.main(args)
    args.shape = args.shape or list(DEFAULT_SHAPES)
    args.tokens = args.tokens or list(MODEL_TOKENS if args.model else TOKENS)
    if args.gpu:
        from . import bench_gpu

        args.format = args.format if len(args.format) < len(formats.FORMATS) else ["bf16", "mxfp4"]
        args.tokens = args.tokens if args.tokens != list(TOKENS) else [1, 8, 512]
        return bench_gpu.main(args)
    from . import bench_model

    if args.worker_json:
        result = bench_model.run_model_worker(args) if args.model else run_worker(args)
        Path(args.worker_json).write_text(json.dumps(result))
        return 0
    try:
        runs = variant_runs(args.variant)
    except ValueError as error:
        return usage_error(str(error))
    workers = run_workers(args, runs)
    machine = {"cpu": cpu_model(), "threads": args.threads,
               "dram_gbps": statistics.median(w["dram_gbps"] for w in workers)}  # fmt: skip
    if args.model:
        result = {
            "machine": machine,
            "workers": [{k: w[k] for k in ("variant", "dram_gbps", "kernels")} for w in workers],
            "model": {"shape": args.model, "layers": args.layers, "cache_clear_mib": args.cache_clear_mib,
                      "gap_ms": args.gap_ms, "co_runner": args.co_runner, "deferred": args.deferred},
            "model_rows": [row for w in workers for row in w["model_rows"]],
        }  # fmt: skip
        print(bench_model.format_model_table(result))
    else:
        machine["peak_gflops"] = {w["variant"]: w["peak_gflops"] for w in workers}
        result = {
            "machine": machine,
            "workers": [
                {k: w[k] for k in ("variant", "dram_gbps", "peak_gflops", "kernels")} for w in workers
            ],
            "rows": [row for w in workers for row in w["rows"]],
        }
        print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
