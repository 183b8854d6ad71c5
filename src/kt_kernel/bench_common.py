"""What every mode of `python -m kt_kernel bench` shares: the workload (shapes, random weights,
routing, the GGUF rows' weights and the bytes per weight every figure divides by), the timing loop
and progress line, and the worker subprocesses (one per build, KT_KERNEL_CPU_VARIANT forcing it).

bench.py (the command), bench_model.py, bench_guard.py and bench_gpu.py import it; only bench.py
imports the other three, to hand a mode its run, so no two of them import each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import formats
from .gguf_blocks import BLOCK_TYPES, held_bytes_per_weight, held_value_bits

#: name -> (experts E, top-k K, hidden H, intermediate I)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b": (128, 8, 2048, 768),
    "dsv3-32e": (32, 8, 7168, 2048),
    "tiny": (8, 2, 256, 128),  # call overhead; not in the default set
}
DECODE_MAX_TOKENS = 8  # rows up to here report bandwidth, larger ones FLOP/s


# ---------------------------------------------------------------------------------------------
# The workload: weights, routing and inputs of a shape, as every mode draws them.
# ---------------------------------------------------------------------------------------------
def routing(tokens: int, experts: int, top_k: int, generator):
    import torch

    ids = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return ids, weights


@dataclass(frozen=True)
class GgufBenchKind:
    """How the bench makes a GGUF projection: ``bits``-bit values per ``group`` inputs, unsigned with
    a min per group where ``mins`` (as Q4_K), else signed; the scales (and mins) small integers
    times one fp16 per 256 inputs where ``factored`` (as the K-quants), of ``multiple_bits`` (4 or 6:
    up to 15 or 63, as Q2_K's or Q4_K's, held so; 8: up to 127, as Q6_K's int8 scales), else float32
    (held so)."""

    group: int
    bits: int
    mins: bool = False
    factored: bool = False
    multiple_bits: int = 6

    @property
    def value_range(self) -> tuple[int, int]:
        """Unsigned where there are mins and they fit an int8 (as Q4_K's), else signed."""
        top = 2**self.bits
        return (0, top - 1) if self.mins and self.bits < 8 else (-top // 2, top // 2 - 1)

    def bytes_per_weight(self) -> float:
        bits = held_value_bits(self.bits, self.group)
        return held_bytes_per_weight(
            bits, self.group, self.mins, self.factored, self.factored, self.multiple_bits
        )

    @classmethod
    def of_type(cls, type_name: str) -> GgufBenchKind:
        """The kind a ggml type runs as (BLOCK_TYPES): its group, its held bits (4: indices, 2, 3, 5
        or 6: value planes, 8: bytes), its mins, its scales factored where the type's always are."""
        block = BLOCK_TYPES[type_name.upper()]
        return cls(block.group, block.held_bits, block.mins, bool(block.factored), block.multiple_bits)


#: The GGUF rows: ``gguf`` is Q4_K_M's mix, gate and up as Q4_K (4-bit values and a min per 32
#: inputs: held as 4-bit indices), down as Q6_K (6-bit values per 16: held in 6-bit planes), their
#: scales factored as those types' are. ``gguf:TYPE`` runs every projection as that ggml type's kind
#: (GgufBenchKind.of_type), ``gguf:G`` 8-bit values per G inputs with fp32 scales.
GGUF_BENCH_LAYOUT = {
    "gate": GgufBenchKind.of_type("Q4_K"),
    "up": GgufBenchKind.of_type("Q4_K"),
    "down": GgufBenchKind.of_type("Q6_K"),
}
PROJECTIONS = ("gate", "up", "down")


#: The bench entry of method NVFP4: weights quantized as ModelOpt does (nvfp4_bench_tensor), held
#: as GGUF (formats.nvfp4_as_gguf).
NVFP4_ENTRY = "nvfp4"


def format_of(fmt: str) -> formats.WeightFormat:
    """The format of a bench format entry: a format's name, or ``name:G`` (its scale groups of G);
    ``nvfp4``: the format the engine holds it in."""
    return formats.GGUF if fmt == NVFP4_ENTRY else formats.get(fmt.split(":")[0])


def method_of(fmt: str) -> str:
    """The method a bench format entry loads with."""
    return formats.NVFP4_METHOD if fmt == NVFP4_ENTRY else format_of(fmt).name


def nvfp4_bench_tensor(weight):
    """A float weight [E, N, K] quantized as ModelOpt quantizes NVFP4 (an fp32 scale per matrix: its
    largest magnitude / (6 * 448); an E4M3 scale per 16 inputs; the nearest E2M1 values), as
    formats.nvfp4_to_fp8 gives it to load_weights_from_tensors."""
    import torch

    w = weight.float()
    global_scale = (w.abs().amax(dim=(-2, -1)) / (6 * formats.FP8_MAX)).clamp(min=2**-100)
    blocks = w.reshape(*w.shape[:-1], -1, formats.NVFP4_BLOCK)
    block_scale = (blocks.abs().amax(dim=-1) / 6 / global_scale[:, None, None]).clamp(max=formats.FP8_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn)
    step = block_scale.float() * global_scale[:, None, None]
    scaled = blocks / torch.where(step > 0, step, torch.ones_like(step))[..., None]
    index = torch.bucketize(scaled.abs(), formats._E2M1_MIDPOINTS).to(torch.uint8)
    codes = (index | ((scaled < 0).to(torch.uint8) << 3)).reshape(w.shape)
    return formats.nvfp4_to_fp8(formats._pack_nibbles(codes), block_scale.view(torch.uint8), global_scale)


def gguf_layout(fmt: str, projection: str) -> GgufBenchKind | None:
    """The kind of a GGUF entry's projection (GGUF_BENCH_LAYOUT, or ``gguf:G``); None for others."""
    if format_of(fmt) is not formats.GGUF:
        return None
    if ":" not in fmt:
        return GGUF_BENCH_LAYOUT[projection]
    suffix = fmt.split(":")[1]
    return GgufBenchKind(int(suffix), 8) if suffix.isdigit() else GgufBenchKind.of_type(suffix)


def bench_group(fmt: str, projection: str) -> int | None:
    """The group size the bench quantizes a projection with: ``name:G``'s G, GGUF's layout, or None
    (the format's default)."""
    layout = gguf_layout(fmt, projection)
    if layout is not None:
        return layout.group
    return int(fmt.split(":")[1]) if ":" in fmt else None


def _factored(values, group: int, top: int = 63):
    """Per-group values [..., K / group] rounded to integer multiples (|m| <= top) of one fp16 per
    256 inputs, as the K-quants store their scales and mins."""
    import torch

    per_block = 256 // group
    padded = torch.nn.functional.pad(values, (0, -values.shape[-1] % per_block))
    blocks = padded.reshape(*values.shape[:-1], -1, per_block)
    unit = (blocks.abs().amax(dim=-1, keepdim=True) / top).half().float()
    unit = torch.where(unit > 0, unit, torch.ones_like(unit))
    multiples = torch.round(blocks / unit).clamp(-top, top)
    return (multiples * unit).reshape(padded.shape)[..., : values.shape[-1]]


def gguf_bench_tensor(weight, kind: GgufBenchKind):
    """A float weight [..., N, K] as a ggml type of that kind would hold it, canonical GGUF: per group
    the scale (and min) that spans the group's weights on the kind's values."""
    import torch

    low, high = kind.value_range
    blocks = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // kind.group, kind.group)
    if kind.mins:
        minimum = blocks.amin(dim=-1).clamp(max=0)
        scale = (blocks.amax(dim=-1) - minimum) / high
    else:
        minimum = torch.zeros(blocks.shape[:-1])
        scale = blocks.abs().amax(dim=-1) / high
    if kind.factored:
        top = 127 if kind.multiple_bits == 8 else 2**kind.multiple_bits - 1
        scale = _factored(scale, kind.group, top)
        if kind.mins:  # a file's min is -(dmin * m): a 0 multiple is -0.0, as a negative factor gives back
            minimum = -_factored(0.0 - minimum, kind.group, top)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((blocks - minimum[..., None]) / safe[..., None]).clamp(low, high)
    pairs = torch.stack([scale, minimum], dim=-1).reshape(*scale.shape[:-1], -1)
    return q.to(torch.int8).reshape(weight.shape), pairs


def weight_bytes(fmt: str) -> float:
    """Bytes per weight, scales included, over the three projections (of one size each): group scales
    at the bench's group (the largest, the one quantize-on-load picks for every shape here, but
    GGUF's and a given G), a scale per row counted as negligible; GGUF's as its kinds are held."""
    if fmt == NVFP4_ENTRY:
        return 0.5 + 1 / formats.NVFP4_BLOCK
    f = format_of(fmt)
    if not f.group_scales:
        return f.value_bits / 8
    total = 0.0
    for p in PROJECTIONS:
        layout = gguf_layout(fmt, p)
        if layout is not None:
            total += layout.bytes_per_weight()
        else:
            group = bench_group(fmt, p) or max(f.scale_groups)
            total += f.value_bits / 8 + f.scales_per_group * f.scale_bytes / group
    return total / len(PROJECTIONS)


def load_bench_weights(moe, fmt: str, gate, up, down) -> None:
    """Float weights quantized on load, or in the bench's groups and bits (GGUF, name:G)."""
    f = format_of(fmt)
    if fmt == NVFP4_ENTRY:
        (gv, gs), (uv, us), (dv, ds) = (nvfp4_bench_tensor(w) for w in (gate, up, down))
        moe.load_weights_from_tensors(gv, uv, dv, gate_scale=gs, up_scale=us, down_scale=ds)
        return
    if bench_group(fmt, "gate") is None:
        moe.load_weights_from_tensors(gate, up, down)
        return
    quantized = {}
    for p, w in zip(PROJECTIONS, (gate, up, down), strict=True):
        layout = gguf_layout(fmt, p)
        quantized[p] = gguf_bench_tensor(w, layout) if layout else f.quantize(w, bench_group(fmt, p))
    moe.load_weights_from_tensors(
        *(quantized[p][0] for p in PROJECTIONS), **{f"{p}_scale": quantized[p][1] for p in PROJECTIONS}
    )


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
    """`count` calls' (hidden states, routing), each with its own routing (seed 0)."""
    import torch

    experts, top_k, hidden, _ = SHAPES[shape]
    rng = torch.Generator().manual_seed(0)
    inputs = []
    for _ in range(count):
        ids, weights = routing(tokens, experts, top_k, rng)
        inputs.append((torch.randn(tokens, hidden, generator=rng).to(torch.bfloat16), ids, weights))
    return inputs


def build_label(kernels: dict[str, str]) -> str:
    """The build's name, "-plain" when an AVX512 build runs without its BF16 and VNNI paths, or the
    AVX2 build without the AVX-VNNI this CPU has."""
    import kt_kernel

    variant = kt_kernel.__cpu_variant__
    fast = "vdpbf16ps" in kernels["bf16_path"] or "vpdpbusd" in kernels["int8_path"]
    if variant == "avx2":
        return variant + ("-plain" if not fast and "avx_vnni" in host_flags() else "")
    return variant + ("" if fast else "-plain")


def progress(done: int, total: int, what: str) -> None:
    width = 24
    filled = width * done // max(total, 1)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<40}", end="", file=sys.stderr)
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# The parent's side: one worker subprocess per build.
# ---------------------------------------------------------------------------------------------
# A build without the finer paths this CPU offers it, as the CPUs without them run it: AVX512 without
# BF16 and VNNI (Skylake-SP), AVX2 without AVX-VNNI (Haswell, Zen 1-4).
PLAIN_ENV = {
    "avx512-plain": {"KT_KERNEL_DISABLE_AVX512_BF16": "1", "KT_KERNEL_DISABLE_AVX512_VNNI": "1"},
    "avx2-plain": {"KT_KERNEL_DISABLE_AVX_VNNI": "1"},
}
# A build forced below what the CPU has is compared with torch held to that build's instructions too,
# as on the CPUs the loader picks that build for: oneDNN's (F.linear in bf16) and ATen's own kernels.
TORCH_ISA_ENV = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx512-plain": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2-plain": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def host_flags() -> set[str]:
    from kt_kernel.loader import cpu_flags, read_cpuinfo

    return cpu_flags(read_cpuinfo()[0])


def runnable_variants() -> list[str]:
    from kt_kernel.loader import VARIANTS, missing_flags

    flags = host_flags()
    return [v for v in VARIANTS if not missing_flags(v, flags)]


def plain_runs(build: str) -> tuple[str, ...]:
    """The build's plain run where this CPU has the paths it leaves out (see PLAIN_ENV)."""
    if build == "avx512" or (build == "avx2" and "avx_vnni" in host_flags()):
        return (f"{build}-plain",)
    return ()


def variant_runs(spec: str) -> list[tuple[str, dict[str, str]]]:
    """(build, extra environment) of each worker that `--variant spec` asks for ("" = the build
    import picks); a ValueError names a build that does not exist or that this CPU cannot run."""
    from kt_kernel.loader import VARIANTS

    if spec == "auto":
        return [("", {})]
    runnable = runnable_variants()
    names = [v.strip() for v in spec.split(",")]
    if spec == "all":
        names = [n for v in runnable for n in (v, *plain_runs(v))]
    runs = []
    for name in names:
        build = name.removesuffix("-plain")
        if build not in VARIANTS or (name != build and name not in PLAIN_ENV):
            valid = ", ".join(["auto", "all", *VARIANTS, *PLAIN_ENV])
            raise ValueError(f"--variant {name!r} is not a build; valid values: {valid}")
        if build not in runnable:
            raise ValueError(f"--variant {name}: this CPU cannot run the {build} build")
        runs.append((build, PLAIN_ENV.get(name, {}) | TORCH_ISA_ENV.get(name, {})))
    return runs


def opt(value: float | None, fmt: str) -> str:
    """A table cell: the value formatted, or "-" where there is none."""
    return format(value, fmt) if value is not None else "-"


def usage_error(message: str) -> int:
    print(f"kt-kernel bench: error: {message}", file=sys.stderr)
    return 2


def format_modes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(format, activations mode) of every row kind: the int8-activation mode exists only for the
    formats that multiply int8 activations (`quantized_activations` in the registry)."""
    return [
        (f, mode)
        for f in args.format
        for mode in args.activations
        if mode != "int8" or format_of(f).quantized_activations
    ]


def activations_label(fmt: str, mode: str) -> str:
    return fmt + ("-i8act" if mode == "int8" else "")


def worker_command(args: argparse.Namespace, out: str) -> list[str]:
    command = [sys.executable, "-m", "kt_kernel", "bench", "--worker-json", out,
               "--format", *args.format, "--tokens", *map(str, args.tokens), "--threads", str(args.threads),
               "--calls", str(args.calls), "--row-seconds", str(args.row_seconds),
               "--activations", *args.activations]  # fmt: skip
    if args.model:
        command += ["--model", args.model, "--layers", str(args.layers),
                    "--cache-clear-mib", str(args.cache_clear_mib), "--gap-ms", str(args.gap_ms)]  # fmt: skip
        command += ["--weight-sets", str(args.weight_sets)] if args.weight_sets else []
        command += ["--co-runner"] if args.co_runner else []
        command += ["--deferred", str(args.deferred)] if args.deferred is not None else []
    else:
        command += ["--shape", *args.shape]
        command += [] if args.torch else ["--no-torch"]
    return command


def run_workers(args: argparse.Namespace, runs: list[tuple[str, dict[str, str]]]) -> list[dict]:
    """One worker subprocess per (build, extra environment) of `runs`: their results, in order."""
    workers = []
    for variant, extra_env in runs:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = dict(os.environ) | extra_env
            if variant:
                env["KT_KERNEL_CPU_VARIANT"] = variant
            subprocess.run(worker_command(args, out.name), env=env, check=True)
            workers.append(json.loads(Path(out.name).read_text()))
    return workers
