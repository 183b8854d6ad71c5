"""`python -m kt_kernel bench --load`: how fast load_weights() reads one layer from each checkpoint
format a model ships in, against how fast the disk (here: the page cache) gives the file's bytes.

Each format's layer is written once to a temporary directory, in the layout the loaders read without
conversion: BF16 and FP8 (128 x 128 block scales) as Hugging Face directories, MXFP4 in
DeepSeek-V4-Flash's layout, NVFP4 as ModelOpt writes it, GGUF as Q4_K_M's mix (gate and up Q4_K, down
Q6_K). Every timed load runs in a fresh process with the file in the page cache, with the engine's
and torch's threads both set to the row's thread count; rows print the median of ``--load-runs``
runs, which alternate between the thread counts and formats so that a busy machine slows them alike.
With ``--load-cache`` each run also loads through ``mmap_experts_dir`` (kt_kernel.expert_cache): a
first load that packs and writes the cache, then two processes mapping it at once (their load time,
anonymous RSS and Pss of the cache's pages); with ``--load-forward`` each process then times the
layer's forward at those token counts, and prints a digest of each output, so the mapped layer is
shown both as fast as and bit-equal to the packed one. Figures only: nothing is asserted about them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


# The timed load, in a fresh process: the layer's figures as JSON on stdout. With a cache directory
# the layer loads through mmap_experts_dir; with token counts its forward is timed after the load;
# with "hold" the process waits for a line on stdin before it exits (the parent reads its /proc).
_CHILD = """
import hashlib, json, resource, statistics, sys, time, torch
from kt_kernel import KTMoEWrapper
path, method, experts, hidden, inter, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
cache, hold = sys.argv[7] or None, sys.argv[9] == "hold"
tokens = [int(t) for t in sys.argv[8].split(",") if t]
torch.set_num_threads(threads)
moe = KTMoEWrapper(layer_idx=0, num_experts=experts, num_experts_per_tok=min(8, experts), hidden_size=hidden,
                   moe_intermediate_size=inter, gpu_experts_mask=torch.zeros(experts, dtype=torch.bool),
                   cpuinfer_threads=threads, threadpool_count=1, weight_path=path, chunked_prefill_size=512,
                   method=method, mmap_experts_dir=cache)
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM, the peak, starts again from here
before = {field: kib(field) for field in ("RssAnon", "VmRSS")}
cpu, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
moe.load_weights()
seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
engines = [sp.engine for sp in moe._subpools]
figures = {"seconds": seconds, "held_bytes": sum(e.packed_bytes() for e in engines),
           "mapped": all(e.mapped for e in engines), "anon_kib": kib("RssAnon") - before["RssAnon"],
           "peak_kib": kib("VmHWM") - before["VmRSS"], "user_s": after.ru_utime - cpu.ru_utime,
           "sys_s": after.ru_stime - cpu.ru_stime, "forward_ms": {}, "digests": {},
           "anon_huge_kib": next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
                                 if line.startswith("AnonHugePages:"))}
g = torch.Generator().manual_seed(1)
for t in tokens:
    x = torch.randn(t, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[: min(8, experts)] for _ in range(t)])
    weights = torch.rand(ids.shape, generator=g)
    times = []
    for _ in range(3 + max(5, 64 // t)):
        start = time.perf_counter()
        y = moe.forward(x, ids, weights)
        times.append(time.perf_counter() - start)
    figures["forward_ms"][t] = statistics.median(times[3:]) * 1e3
    figures["digests"][t] = hashlib.sha256(y.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
print(json.dumps(figures), flush=True)
if hold:
    sys.stdin.readline()
"""


def _child(path: Path, method: str, sizes: tuple[int, int, int], threads: int, cache: Path | None,
           tokens: list[int], hold: bool) -> subprocess.Popen:  # fmt: skip
    argv = [sys.executable, "-c", _CHILD, str(path), method, *map(str, sizes), str(threads),
            str(cache or ""), ",".join(map(str, tokens)), "hold" if hold else "go"]  # fmt: skip
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _figures(child: subprocess.Popen, what: str) -> dict:
    line = child.stdout.readline()
    if not line:
        _, err = child.communicate()
        raise RuntimeError(f"{what} failed:\n{err[-3000:]}")
    return json.loads(line)


def _finish(child: subprocess.Popen, what: str) -> None:
    _, err = child.communicate("\n")
    if child.returncode:
        raise RuntimeError(f"{what} failed:\n{err[-3000:]}")


def time_load(path: Path, method: str, sizes: tuple[int, int, int], threads: int, cache: Path | None = None,
              tokens: list[int] = ()) -> dict:  # fmt: skip
    what = f"loading {path} as {method}"
    child = _child(path, method, sizes, threads, cache, list(tokens), hold=False)
    figures = _figures(child, what)
    _finish(child, what)
    return figures


def cache_file_pages(pid: int) -> dict[str, int]:
    """Rss, Pss and what of it is mapped by 2 MiB entries (KiB) of process ``pid``'s mappings of the
    cache's files."""
    from .expert_cache import SUFFIX

    totals, inside = {"Rss": 0, "Pss": 0, "FilePmdMapped": 0}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
                inside = len(fields) >= 6 and fields[-1].endswith(SUFFIX)
            elif inside and fields[0][:-1] in totals:
                totals[fields[0][:-1]] += int(fields[1])
    return totals


def time_mapped_pair(path: Path, method: str, sizes: tuple[int, int, int], threads: int, cache: Path,
                     tokens: list[int]) -> list[dict]:  # fmt: skip
    """Two processes mapping one filled cache, the second started once the first has loaded (and
    timed its forwards): each one's figures with its Rss and Pss of the cache while both are alive."""
    what = f"mapping {path} from {cache}"
    first = _child(path, method, sizes, threads, cache, tokens, hold=True)
    try:
        figures = [_figures(first, what)]
        second = _child(path, method, sizes, threads, cache, tokens, hold=True)
        try:
            figures.append(_figures(second, what))
            for child, got in zip((first, second), figures, strict=True):
                got["cache_kib"] = cache_file_pages(child.pid)
        finally:
            _finish(second, what)
    finally:
        _finish(first, what)
    return figures


def _row(fmt: str, threads: int, mode: str, size: int, read_s: float, got: list[dict]) -> dict:
    """A row's medians; read_s: a raw read of the files this mode loads from (checkpoint or cache)."""
    seconds = statistics.median(s["seconds"] for s in got)
    tokens = got[0]["forward_ms"].keys()
    row = {
        "format": fmt, "threads": threads, "mode": mode, "file_mib": size / 2**20, "load_s": seconds,
        "load_s_all": [s["seconds"] for s in got], "gbps": size / seconds / 1e9, "read_s": read_s,
        "load_per_read": seconds / read_s, "held_per_file": got[0]["held_bytes"] / size,
        "mapped": got[0]["mapped"], "anon_mib": statistics.median(s["anon_kib"] for s in got) / 1024,
        "peak_mib": statistics.median(s["peak_kib"] for s in got) / 1024,
        "user_s": statistics.median(s["user_s"] for s in got),
        "sys_s": statistics.median(s["sys_s"] for s in got),
        "forward_ms": {t: statistics.median(s["forward_ms"][t] for s in got) for t in tokens},
        "digests": got[0]["digests"],
    }  # fmt: skip
    if "cache_kib" in got[0]:
        row["cache_pss_mib"] = statistics.median(s["cache_kib"]["Pss"] for s in got) / 1024
        row["cache_rss_mib"] = statistics.median(s["cache_kib"]["Rss"] for s in got) / 1024
        row["huge_mib"] = statistics.median(s["cache_kib"]["FilePmdMapped"] for s in got) / 1024
    else:
        row["huge_mib"] = statistics.median(s["anon_huge_kib"] for s in got) / 1024
    return row


def run(formats: list[str], sizes: tuple[int, int, int], threads: list[int], runs: int, directory: Path,
        cache: bool = False, tokens: list[int] = ()) -> list[dict]:  # fmt: skip
    """Per (format, threads, mode): the median figures of ``runs`` loads, interleaved. Modes: packed
    (no cache); with ``cache`` also first (packs and fills a new cache) and mapped (two processes map
    it)."""
    paths = {fmt: write_layer(fmt, directory / fmt, *sizes) for fmt in formats}
    modes = ("packed", "first", "mapped") if cache else ("packed",)
    samples: dict[tuple[str, int, str], list[dict]] = {
        (f, t, m): [] for f in formats for t in threads for m in modes
    }
    reads: dict[tuple[str, str], list[float]] = {}
    for run_index in range(runs):
        for fmt in formats:
            reads.setdefault((fmt, "source"), []).append(read_seconds(paths[fmt]))  # into the page cache too
            for t in threads:
                samples[fmt, t, "packed"].append(
                    time_load(paths[fmt], LOAD_FORMATS[fmt], sizes, t, tokens=tokens)
                )
                if not cache:
                    continue
                cache_dir = directory / f"cache-{fmt}-{t}-{run_index}"
                samples[fmt, t, "first"].append(
                    time_load(paths[fmt], LOAD_FORMATS[fmt], sizes, t, cache_dir, tokens)
                )
                reads.setdefault((fmt, f"cache{t}"), []).append(read_seconds(cache_dir))
                samples[fmt, t, "mapped"].extend(
                    time_mapped_pair(paths[fmt], LOAD_FORMATS[fmt], sizes, t, cache_dir, tokens)
                )
                shutil.rmtree(cache_dir)
    rows = []
    for (fmt, t, mode), got in samples.items():
        read = reads[fmt, f"cache{t}" if mode == "mapped" else "source"]
        rows.append(_row(fmt, t, mode, file_bytes(paths[fmt]), statistics.median(read), got))
    for row in rows:  # the same outputs as the packed layer's, token count by token count
        key = (row["format"], row["threads"], "packed")
        packed = next(r for r in rows if (r["format"], r["threads"], r["mode"]) == key)
        row["same_outputs"] = row["digests"] == packed["digests"]
    return rows


#: The table's columns: heading, row key, width and format.
COLUMNS = (
    ("format", "format", 7, ""), ("threads", "threads", 7, ""), ("mode", "mode", 6, ""),
    ("file MiB", "file_mib", 9, ".1f"), ("load s", "load_s", 7, ".3f"), ("GB/s of file", "gbps", 12, ".2f"),
    ("read s", "read_s", 7, ".3f"), ("load/read", "load_per_read", 9, ".2f"),
    ("held/file", "held_per_file", 9, ".2f"), ("anon MiB", "anon_mib", 8, ".1f"),
    ("huge MiB", "huge_mib", 8, ".0f"), ("peak MiB", "peak_mib", 8, ".1f"), ("user s", "user_s", 7, ".2f"),
    ("sys s", "sys_s", 6, ".2f"),
)  # fmt: skip


def format_table(rows: list[dict]) -> str:
    """The rows under COLUMNS' headings, then the cache's pages and forward times where measured.
    read s: a raw read of what the mode loads from (the checkpoint; mapped: the cache's file). huge
    MiB: of the layer, what is on 2 MiB pages (anonymous ones; mapped: the cache's file pages). sys s:
    the kernel's time in the load, mostly first touches of the packed layer's fresh memory (on a
    virtual machine, memory the host has not backed yet is slow)."""
    tokens = list(rows[0]["forward_ms"]) if rows else []
    head = ["  ".join(f"{heading:>{width}}" for heading, _, width, _ in COLUMNS)]
    head[0] += "".join(f"  {'fwd ms T=' + str(t):>13}" for t in tokens)
    mapped = any("cache_pss_mib" in row for row in rows)
    if mapped:
        head[0] += "  cache Rss/Pss MiB"
    if tokens:
        head[0] += "  same outputs"
    lines = head
    for row in rows:
        line = "  ".join(f"{row[key]:>{width}{spec}}" for _, key, width, spec in COLUMNS)
        line += "".join(f"  {row['forward_ms'][t]:>13.3f}" for t in tokens)
        if mapped:
            pages = (
                f"{row['cache_rss_mib']:.0f}/{row['cache_pss_mib']:.0f}" if "cache_pss_mib" in row else "-"
            )
            line += f"  {pages:>18}"
        if tokens:
            line += f"  {'yes' if row['same_outputs'] else 'NO':>12}"
        lines.append(line)
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
    group.add_argument(
        "--load-cache", action="store_true",
        help="also load through mmap_experts_dir: a first load filling a new cache, then two processes "
        "mapping it",
    )  # fmt: skip
    group.add_argument(
        "--load-forward", nargs="+", type=int, default=[], metavar="T",
        help="after each load, time the layer's forward at these token counts (and compare outputs)",
    )  # fmt: skip


def main(args: argparse.Namespace, shapes: dict[str, tuple[int, int, int, int]]) -> int:
    formats = args.load or list(LOAD_FORMATS)
    if args.load_shape:
        experts, hidden, inter = args.load_shape
    else:
        experts, _, hidden, inter = shapes[(args.shape or ["qwen3-30b"])[0]]
    threads = args.load_threads or sorted({1, args.threads})
    with tempfile.TemporaryDirectory(dir=args.load_dir) as directory:
        rows = run(
            formats,
            (experts, hidden, inter),
            threads,
            args.load_runs,
            Path(directory),
            args.load_cache,
            args.load_forward,
        )
    print(f"load_weights() of one layer: E={experts} H={hidden} I={inter}, median of {args.load_runs} "
          f"fresh-process runs (cpus: {os.cpu_count()})")  # fmt: skip
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [experts, hidden, inter], "rows": rows}, indent=2))
    return 0
