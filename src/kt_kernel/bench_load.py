"""`python -m kt_kernel bench --load`: how fast load_weights() reads one layer from each checkpoint
format a model ships in, against how fast the disk (here: the page cache) gives the file's bytes.

Each format's layer is written once to a temporary directory, in the layout the loaders read without
conversion: BF16 and FP8 (128 x 128 block scales) as Hugging Face directories, MXFP4 in
DeepSeek-V4-Flash's layout, NVFP4 as ModelOpt writes it, GGUF as Q4_K_M's mix (gate and up Q4_K, down
Q6_K). Every timed load runs in a fresh process with the file in the page cache, with the engine's
and torch's threads both set to the row's thread count; rows print the median of ``--load-runs``
runs, which alternate between the thread counts and formats so that a busy machine slows them alike.
Figures only: nothing is asserted about them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

#: The formats the load bench writes, and the method load_weights reads each with.
LOAD_FORMATS = {"bf16": "BF16", "fp8": "FP8", "mxfp4": "MXFP4", "nvfp4": "NVFP4", "gguf": "GGUF"}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
              torch.uint8: "U8", torch.int8: "I8", torch.float8_e8m0fnu: "F8_E8M0"}  # fmt: skip
_PROJECTIONS = ("gate", "up", "down")


def _shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


#: One tensor of a checkpoint: its name, a function making it, its safetensors dtype and shape.
Entry = tuple[str, Callable[[], torch.Tensor], str, list[int]]


def write_safetensors(file: Path, entries: Iterable[Entry]) -> None:
    """A safetensors file written tensor by tensor, so that only one tensor is in memory at a time."""
    entries = list(entries)
    header, offset = {}, 0
    for name, _, dtype, shape in entries:
        size = int(np.prod(shape)) * {"F32": 4, "BF16": 2}.get(dtype, 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, make, dtype, shape in entries:
            tensor = make().contiguous()
            assert _ST_DTYPES[tensor.dtype] == dtype and list(tensor.shape) == shape, name
            f.write(tensor.view(torch.uint8).numpy().tobytes())


def _random_bytes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _fp8_codes(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    codes = _random_bytes(g, n, k)
    codes = torch.where((codes & 0x78) == 0, codes | 0x40, codes)  # normal codes, as real weights have
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes).view(torch.float8_e4m3fn)


def _expert_tensors(
    fmt: str, n: int, k: int, g: torch.Generator
) -> list[tuple[str, Callable, str, list[int]]]:
    """One projection of one expert: (name suffix, maker, dtype, shape) per tensor."""
    if fmt == "bf16":
        return [("weight", lambda: (torch.randn(n, k, generator=g) * 0.02).bfloat16(), "BF16", [n, k])]
    if fmt == "fp8":  # DeepSeek: one fp32 multiplier per 128 x 128 block
        blocks = [-(-n // 128), -(-k // 128)]
        return [
            ("weight", lambda: _fp8_codes(g, n, k), "F8_E4M3", [n, k]),
            ("weight_scale_inv", lambda: torch.rand(*blocks, generator=g) * 1e-3 + 1e-4, "F32", blocks),
        ]
    if fmt == "mxfp4":  # DeepSeek-V4-Flash: E2M1 pairs as I8, E8M0 scales per 32 inputs
        scales = [n, k // 32]
        return [
            ("weight", lambda: _random_bytes(g, n, k // 2).view(torch.int8), "I8", [n, k // 2]),
            ("scale", lambda: _random_bytes(g, *scales).remainder_(10).add_(118).view(torch.float8_e8m0fnu),
             "F8_E8M0", scales),
        ]  # fmt: skip
    # NVFP4, as ModelOpt writes it: E2M1 pairs, E4M3 scales per 16 inputs, one fp32 scale per tensor
    return [
        ("weight", lambda: _random_bytes(g, n, k // 2), "U8", [n, k // 2]),
        ("weight_scale", lambda: (torch.rand(n, k // 16, generator=g) * 1.45 + 0.05).to(torch.float8_e4m3fn),
         "F8_E4M3", [n, k // 16]),
        ("weight_scale_2", lambda: torch.tensor([1 / 3]), "F32", [1]),
    ]  # fmt: skip


def _hf_entries(fmt: str, experts: int, hidden: int, inter: int, g: torch.Generator) -> Iterator[Entry]:
    """One layer's experts, named as the format's checkpoints name them."""
    names = {"gate": "w1", "up": "w3", "down": "w2"}  # DeepSeek-V4-Flash's
    for e in range(experts):
        for projection, (n, k) in _shapes(hidden, inter).items():
            if fmt == "mxfp4":
                base = f"layers.0.ffn.experts.{e}.{names[projection]}."
            else:
                base = f"model.layers.0.mlp.experts.{e}.{projection}_proj."
            for suffix, make, dtype, shape in _expert_tensors(fmt, n, k, g):
                yield base + suffix, make, dtype, shape


def _k_quant_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K or Q6_K blocks [rows, K's bytes]: random bytes with small finite fp16 fields."""
    from .gguf_blocks import BLOCK_TYPES

    block = BLOCK_TYPES[type_name]
    count = rows * k // block.block_inputs
    blocks = rng.integers(0, 256, (count, block.block_bytes), dtype=np.uint8)
    for offset in {"Q4_K": (0, 2), "Q6_K": (208,)}[type_name]:
        field = (rng.standard_normal(count) * 1e-3).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def write_gguf(file: Path, experts: int, hidden: int, inter: int, rng: np.random.Generator) -> None:
    """Q4_K_M's mix for one layer's experts: gate and up Q4_K, down Q6_K."""
    import gguf

    writer = gguf.GGUFWriter(file, "qwen3moe")
    writer.add_expert_count(experts)
    writer.add_expert_used_count(8)
    writer.add_embedding_length(hidden)
    writer.add_expert_feed_forward_length(inter)
    for projection, (n, k) in _shapes(hidden, inter).items():
        type_name = "Q6_K" if projection == "down" else "Q4_K"
        raw = _k_quant_blocks(type_name, experts * n, k, rng).reshape(experts, n, -1)
        writer.add_tensor(
            f"blk.0.ffn_{projection}_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType[type_name]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_layer(fmt: str, directory: Path, experts: int, hidden: int, inter: int) -> Path:
    """The layer in ``fmt`` under ``directory``: the weight_path load_weights takes."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        write_gguf(directory / "layer.gguf", experts, hidden, inter, np.random.default_rng(0))
        return directory / "layer.gguf"
    entries = _hf_entries(fmt, experts, hidden, inter, torch.Generator().manual_seed(0))
    write_safetensors(directory / "model.safetensors", entries)
    return directory


def file_bytes(path: Path) -> int:
    files = [path] if path.is_file() else [f for f in path.iterdir() if f.is_file()]
    return sum(f.stat().st_size for f in files)


def read_seconds(path: Path) -> float:
    """Seconds to read every byte of the layer's files (one thread, 8 MiB at a time)."""
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    buffer = bytearray(8 << 20)
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


# The timed load, in a fresh process: the layer's figures as JSON on stdout.
_CHILD = """
import json, resource, sys, time, torch
from kt_kernel import KTMoEWrapper
path, method, experts, hidden, inter, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
torch.set_num_threads(threads)
moe = KTMoEWrapper(layer_idx=0, num_experts=experts, num_experts_per_tok=min(8, experts), hidden_size=hidden,
                   moe_intermediate_size=inter, gpu_experts_mask=torch.zeros(experts, dtype=torch.bool),
                   cpuinfer_threads=threads, threadpool_count=1, weight_path=path, chunked_prefill_size=64,
                   method=method)
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM, the peak, starts again from here
before = {field: kib(field) for field in ("RssAnon", "VmRSS")}
cpu, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
moe.load_weights()
seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
held = sum(sp.engine.packed_bytes() for sp in moe._subpools)
print(json.dumps({"seconds": seconds, "held_bytes": held, "anon_kib": kib("RssAnon") - before["RssAnon"],
                  "peak_kib": kib("VmHWM") - before["VmRSS"], "user_s": after.ru_utime - cpu.ru_utime,
                  "sys_s": after.ru_stime - cpu.ru_stime}))
"""


def time_load(path: Path, method: str, sizes: tuple[int, int, int], threads: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), method, *map(str, sizes), str(threads)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode:
        raise RuntimeError(f"loading {path} as {method} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(
    formats: list[str], sizes: tuple[int, int, int], threads: list[int], runs: int, directory: Path
) -> list[dict]:
    """Per (format, threads): the median figures of ``runs`` loads, interleaved."""
    paths = {fmt: write_layer(fmt, directory / fmt, *sizes) for fmt in formats}
    samples: dict[tuple[str, int], list[dict]] = {(f, t): [] for f in formats for t in threads}
    reads: dict[str, list[float]] = {f: [] for f in formats}
    for _ in range(runs):
        for fmt in formats:
            reads[fmt].append(read_seconds(paths[fmt]))  # also brings the file into the page cache
            for t in threads:
                samples[fmt, t].append(time_load(paths[fmt], LOAD_FORMATS[fmt], sizes, t))
    rows = []
    for (fmt, t), got in samples.items():
        size = file_bytes(paths[fmt])
        seconds = statistics.median(s["seconds"] for s in got)
        rows.append({
            "format": fmt, "threads": t, "file_mib": size / 2**20, "load_s": seconds,
            "load_s_all": [s["seconds"] for s in got], "gbps": size / seconds / 1e9,
            "read_gbps": size / statistics.median(reads[fmt]) / 1e9,
            "held_per_file": got[0]["held_bytes"] / size,
            "anon_mib": statistics.median(s["anon_kib"] for s in got) / 1024,
            "peak_mib": statistics.median(s["peak_kib"] for s in got) / 1024,
            "user_s": statistics.median(s["user_s"] for s in got),
            "sys_s": statistics.median(s["sys_s"] for s in got),
        })  # fmt: skip
    return rows


#: The table's columns: heading, row key, width and format.
COLUMNS = (
    ("format", "format", 7, ""), ("threads", "threads", 7, ""), ("file MiB", "file_mib", 9, ".1f"),
    ("load s", "load_s", 7, ".3f"), ("GB/s of file", "gbps", 12, ".2f"),
    ("raw read GB/s", "read_gbps", 13, ".2f"), ("held/file", "held_per_file", 9, ".2f"),
    ("anon MiB", "anon_mib", 8, ".1f"), ("peak MiB", "peak_mib", 8, ".1f"), ("user s", "user_s", 7, ".2f"),
    ("sys s", "sys_s", 6, ".2f"),
)  # fmt: skip


def format_table(rows: list[dict]) -> str:
    """The rows under COLUMNS' headings. sys s: the kernel's time in the load, mostly first touches of
    the packed layer's fresh memory (on a virtual machine, memory the host has not backed yet is slow)."""
    lines = ["  ".join(f"{heading:>{width}}" for heading, _, width, _ in COLUMNS)]
    for row in rows:
        lines.append("  ".join(f"{row[key]:>{width}{spec}}" for _, key, width, spec in COLUMNS))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load mode", "time load_weights() from checkpoints (bench_load.py)")
    group.add_argument(
        "--load", nargs="*", choices=list(LOAD_FORMATS), metavar="FORMAT",
        help="time loading a layer of --shape (default qwen3-30b) from each format: "
        f"{', '.join(LOAD_FORMATS)} (none named: all)",
    )  # fmt: skip
    group.add_argument(
        "--load-shape", nargs=3, type=int, metavar=("E", "H", "I"),
        help="experts, hidden and intermediate size of the layer, instead of --shape's (GGUF's K-quants "
        "need H and I to be multiples of 256)",
    )  # fmt: skip
    group.add_argument("--load-threads", nargs="+", type=int, metavar="T", help="default: 1 and --threads")
    group.add_argument("--load-runs", type=int, default=3, metavar="R", help="fresh-process loads per row")
    group.add_argument(
        "--load-dir", metavar="DIR", help="write the layers here (default: a temporary directory)"
    )


def main(args: argparse.Namespace, shapes: dict[str, tuple[int, int, int, int]]) -> int:
    formats = args.load or list(LOAD_FORMATS)
    if args.load_shape:
        experts, hidden, inter = args.load_shape
    else:
        experts, _, hidden, inter = shapes[(args.shape or ["qwen3-30b"])[0]]
    threads = args.load_threads or sorted({1, args.threads})
    with tempfile.TemporaryDirectory(dir=args.load_dir) as directory:
        rows = run(formats, (experts, hidden, inter), threads, args.load_runs, Path(directory))
    print(f"load_weights() of one layer: E={experts} H={hidden} I={inter}, median of {args.load_runs} "
          f"fresh-process runs (cpus: {os.cpu_count()})")  # fmt: skip
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [experts, hidden, inter], "rows": rows}, indent=2))
    return 0
