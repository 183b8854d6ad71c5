"""`python -m kt_kernel bench`: the standard MoE workload (shared/bench/WORKLOAD.md) through KTMoEWrapper.

Each build runs in its own subprocess (KT_KERNEL_CPU_VARIANT forces it). A worker measures the machine
(DRAM read bandwidth, peak multiply-add rates) with the same threads, then times every row: random
weights quantized on load, routing drawn afresh for every call (seed 0), and the same calls in plain
PyTorch side by side: per-expert F.linear in bf16 for bf16 and mxfp4 (torch has no MXFP4 kernel),
torch._weight_int8pack_mm / torch._weight_int4pack_mm_for_cpu on the same quantized weights for int8
and int4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

#: name -> (experts E, top-k K, hidden H, intermediate I)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b": (128, 8, 2048, 768),
    "dsv3-32e": (32, 8, 7168, 2048),
    "tiny": (8, 2, 256, 128),  # call overhead; not in the default set
}
DEFAULT_SHAPES = ("qwen3-30b", "dsv3-32e")
TOKENS = (1, 8, 64, 512)
#: bytes per weight, scales included (int4: fp32 scale per 128, the group quantize-on-load picks for
#: every shape here; int8: fp32 scale per row, negligible)
WEIGHT_BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 128, "mxfp4": 0.5 + 1 / 32}
DECODE_MAX_TOKENS = 8
#: The PyTorch baseline of a format where it is not the format itself: torch has no MXFP4 kernel.
TORCH_FORMAT = {"mxfp4": "bf16"}  # rows up to here report bandwidth, larger ones FLOP/s


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
def routing(tokens: int, experts: int, top_k: int, generator):
    import torch

    ids = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return ids, weights


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


def torch_baseline(fmt: str, gate, up, down):
    """The PyTorch call for a format: (linear, gate, up, down) with weights in torch's own layout."""
    import torch
    import torch.nn.functional as F

    from kt_kernel import quant

    if fmt in ("bf16", "mxfp4"):
        return F.linear, gate, up, down
    if fmt == "int8":

        def int8_weights(w):
            q, s = quant.quantize("INT8", w)
            return q, s.to(torch.bfloat16)

        def int8_linear(x, w):
            return torch._weight_int8pack_mm(x, *w)

        return (int8_linear, *([int8_weights(e) for e in proj] for proj in (gate, up, down)))

    group = quant.DEFAULT_INT4_GROUP_SIZE

    def int4_weights(w):  # torch's int4 is unsigned with w = (q - 8) * scale + zero
        values, scales = quant.quantize("INT4", w, group_size=group)
        q = quant.dequantize("INT4", values, torch.ones_like(scales)).round().to(torch.int32) + 8
        scale_zero = torch.stack([scales.T, torch.zeros_like(scales.T)], dim=-1).to(torch.bfloat16)
        return torch._convert_weight_to_int4pack_for_cpu(q, 2), scale_zero.contiguous()

    def int4_linear(x, w):
        return torch._weight_int4pack_mm_for_cpu(x, w[0], group, w[1])

    return (int4_linear, *([int4_weights(e) for e in proj] for proj in (gate, up, down)))


def time_calls(call, inputs, budget_s: float, min_calls: int, max_calls: int, warmup: int) -> list[float]:
    """Seconds per call, each call on the next routing; stops after max_calls, or after min_calls
    once budget_s is spent."""
    for i in range(warmup):
        call(*inputs[i % len(inputs)])
    times: list[float] = []
    spent = 0.0
    for i in range(max_calls):
        start = time.perf_counter()
        call(*inputs[(warmup + i) % len(inputs)])
        times.append(time.perf_counter() - start)
        spent += times[-1]
        if len(times) >= min_calls and spent > budget_s:
            break
    return times


def random_weights(shape: str, seed: int = 0):
    """bf16 gate, up, down of the shape at the usual 1/sqrt(fan-in) scale (quantized on load)."""
    import torch

    experts, _, hidden, inter = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)

    def uniform(*size: int, fan_in: int):
        weights = torch.empty(*size, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen)
        return weights.mul_((3 / fan_in) ** 0.5)

    gate = uniform(experts, inter, hidden, fan_in=hidden)
    up = uniform(experts, inter, hidden, fan_in=hidden)
    down = uniform(experts, hidden, inter, fan_in=inter)
    return gate, up, down


def call_inputs(shape: str, tokens: int, count: int):
    """`count` calls' (hidden states, routing), each with its own routing (WORKLOAD.md, seed 0)."""
    import torch

    experts, top_k, hidden, _ = SHAPES[shape]
    rng = torch.Generator().manual_seed(0)
    inputs = []
    for _ in range(count):
        ids, weights = routing(tokens, experts, top_k, rng)
        inputs.append((torch.randn(tokens, hidden, generator=rng).to(torch.bfloat16), ids, weights))
    return inputs


def run_worker(args: argparse.Namespace) -> dict:
    import torch

    import kt_kernel
    from kt_kernel import KTMoEWrapper
    from kt_kernel._native import ext

    torch.set_num_threads(args.threads)
    kernels = dict(ext.kernel_info())
    peak = {op: ext.measure_peak_gflops(args.threads, op) for op in ("fma_f32", "dpbf16", "dpint8")}
    dram = ext.measure_read_bandwidth(args.threads, 1 << 29)
    uses_dpbf16 = "vdpbf16ps" in kernels["bf16_path"]
    uses_dpint8 = "vpdpbusd" in kernels["int8_path"]
    # The peak each format's kernel is measured against: its multiply instruction, fp32 FMA where it
    # has none of its own (the issue's yardstick for the AVX2 build).
    integer_op = "dpint8" if uses_dpint8 else "fma_f32"  # MXFP4, INT8, INT4: int8 activations
    peak_ops = {"bf16": "dpbf16" if uses_dpbf16 else "fma_f32", "mxfp4": integer_op, "int8": integer_op,
                "int4": integer_op}  # fmt: skip
    variant = kt_kernel.__cpu_variant__
    label = variant + ("-plain" if variant != "avx2" and not (uses_dpbf16 or uses_dpint8) else "")
    rows: list[Row] = []
    baselines = sorted({TORCH_FORMAT.get(f, f) for f in args.format}) if args.torch else []
    # The int8-activation mode exists for the formats that multiply in integers (all but bf16).
    runs = [
        (f, mode) for f in args.format for mode in args.activations if not (f == "bf16" and mode == "int8")
    ]
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
                threadpool_count=1, weight_path=None, chunked_prefill_size=512, method=fmt.upper(),
                int8_activations=mode == "int8",
            )  # fmt: skip
            moe.load_weights_from_tensors(gate, up, down)
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
                gbps = touched * 3 * hidden * inter * WEIGHT_BYTES[fmt] / median / 1e9
                tflops = 2 * 3 * hidden * inter * tokens * top_k / median / 1e12
                shape_rows.append(
                    Row(
                        variant=label, shape=shape, format=fmt, activations=mode, tokens=tokens,
                        calls=len(times),
                        median_ms=median * 1e3, p10_ms=deciles[0] * 1e3, p90_ms=deciles[-1] * 1e3,
                        tokens_per_s=tokens / median, gbps=gbps, tflops=tflops,
                        dram_gbps=row_dram, pct_of_bandwidth=100 * gbps / row_dram if decode else None,
                        pct_of_peak=None if decode else 100 * tflops * 1e3 / peak[peak_ops[fmt]],
                        peak_op=peak_ops[fmt], torch_median_ms=None, speedup_vs_torch=None,
                    )
                )  # fmt: skip
            del moe
        # PyTorch after the engine's rows (its OpenMP threads keep spinning after each call and would
        # take cores from the engine), once per token count and torch format: the same calls.
        for torch_format in baselines:
            linear, *weights = torch_baseline(torch_format, gate, up, down)
            baseline = partial(torch_moe, linear=linear, gate=weights[0], up=weights[1], down=weights[2])
            for tokens in args.tokens:
                progress(step, steps, f"{label} {shape} torch {torch_format} T={tokens}")
                step += 1
                inputs = call_inputs(shape, tokens, args.calls + 2)
                median = statistics.median(
                    time_calls(baseline, inputs, args.row_seconds, min(5, args.calls), args.calls, warmup=1)
                )
                for row in shape_rows:
                    if row.tokens == tokens and torch_format == TORCH_FORMAT.get(row.format, row.format):
                        row.torch_median_ms, row.speedup_vs_torch = median * 1e3, median * 1e3 / row.median_ms
            del baseline, weights
        rows += shape_rows
    progress(steps, steps, "done\n")
    return {"variant": label, "dram_gbps": dram, "peak_gflops": peak, "kernels": kernels,
            "rows": [asdict(r) for r in rows]}  # fmt: skip


def progress(done: int, total: int, what: str) -> None:
    width = 24
    filled = width * done // max(total, 1)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}", end="", file=sys.stderr)
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Parent: one subprocess per build, then the table.
# ---------------------------------------------------------------------------------------------
def runnable_variants() -> list[str]:
    from kt_kernel.loader import VARIANTS, cpu_flags, missing_flags, read_cpuinfo

    flags = cpu_flags(read_cpuinfo()[0])
    return [v for v in VARIANTS if not missing_flags(v, flags)]


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [f"machine: {m['cpu']}, {m['threads']} threads"]
    for w in result["workers"]:
        peaks = ", ".join(f"{op} {g:.0f} G/s" for op, g in w["peak_gflops"].items() if g)  # FLOP or int OP
        lines.append(f"  {w['variant']:<12} DRAM read {w['dram_gbps']:.1f} GB/s; peak {peaks}")
    header = (
        f"{'build':<12} {'shape':<10} {'format':<9} {'T':>4} {'median ms':>10} {'p10-p90 ms':>15} "
        f"{'tok/s':>9} {'GB/s':>6} {'DRAM':>5} {'%BW':>5} {'TFLOP/s':>8} {'%peak':>6} {'torch ms':>9} "
        f"{'speedup':>7}"
    )
    lines += ["", header, "-" * len(header)]

    def opt(value, fmt):
        return format(value, fmt) if value is not None else "-"

    for r in result["rows"]:
        lines.append(
            f"{r['variant']:<12} {r['shape']:<10} "
            f"{r['format'] + ('-i8act' if r['activations'] == 'int8' else ''):<9} "
            f"{r['tokens']:>4} {r['median_ms']:>10.2f} "
            f"{r['p10_ms']:>7.2f}-{r['p90_ms']:<7.2f} {r['tokens_per_s']:>9.1f} {r['gbps']:>6.1f} "
            f"{opt(r['dram_gbps'], '5.1f'):>5} {opt(r['pct_of_bandwidth'], '5.0f'):>5} {r['tflops']:>8.3f} "
            f"{opt(r['pct_of_peak'], '6.0f'):>6} "
            f"{opt(r['torch_median_ms'], '9.2f'):>9} {opt(r['speedup_vs_torch'], '6.2f'):>6}x"
        )
    lines.append(
        "\n%BW (T <= 8): effective bandwidth (distinct expert weights touched / latency) vs DRAM, the read "
        "bandwidth measured just before the row.\n%peak (T >= 64): vs the measured peak of the instruction "
        "the kernel uses (vdpbf16ps, vpdpbusd, or fp32 FMA where it has neither).\ntorch: per-expert "
        "F.linear in bf16 (bf16, mxfp4), torch._weight_int8pack_mm (int8), _weight_int4pack_mm_for_cpu "
        "(int4).\n-i8act: the opt-in int8_activations=True mode (lossy on outlier activations)."
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kt_kernel.experts import IMPLEMENTED_FORMATS

    formats = [f.lower() for f in IMPLEMENTED_FORMATS]
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(DEFAULT_SHAPES))
    parser.add_argument("--format", nargs="+", choices=formats, default=formats)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument(
        "--variant",
        default="auto",
        help="auto (the build import picks), all, or a comma list: amx,avx512,avx2",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per row (fewer for slow rows)")
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
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.shape, args.tokens, args.calls = ["qwen3-30b"], [1, 64], 10
    if args.worker_json:
        Path(args.worker_json).write_text(json.dumps(run_worker(args)))
        return 0
    if args.variant == "all":
        variants = runnable_variants()
    elif args.variant == "auto":
        variants = [""]
    else:
        variants = [v.strip() for v in args.variant.split(",")]
    workers = []
    for variant in variants:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = dict(os.environ)
            if variant:
                env["KT_KERNEL_CPU_VARIANT"] = variant
            command = [sys.executable, "-m", "kt_kernel", "bench", "--worker-json", out.name,
                       "--shape", *args.shape, "--format", *args.format,
                       "--tokens", *map(str, args.tokens), "--threads", str(args.threads),
                       "--calls", str(args.calls), "--row-seconds", str(args.row_seconds),
                       "--activations", *args.activations]  # fmt: skip
            if not args.torch:
                command.append("--no-torch")
            subprocess.run(command, env=env, check=True)
            workers.append(json.loads(Path(out.name).read_text()))
            if variant == "avx512" and args.variant == "all":
                env["KT_KERNEL_DISABLE_AVX512_BF16"] = "1"  # the plain AVX512F / BW paths too
                env["KT_KERNEL_DISABLE_AVX512_VNNI"] = "1"
                subprocess.run(command, env=env, check=True)
                workers.append(json.loads(Path(out.name).read_text()))
    result = {
        "machine": {
            "cpu": cpu_model(),
            "threads": args.threads,
            "dram_gbps": statistics.median(w["dram_gbps"] for w in workers),
            "peak_gflops": {w["variant"]: w["peak_gflops"] for w in workers},
        },
        "workers": [{k: w[k] for k in ("variant", "dram_gbps", "peak_gflops", "kernels")} for w in workers],
        "rows": [row for w in workers for row in w["rows"]],
    }
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
