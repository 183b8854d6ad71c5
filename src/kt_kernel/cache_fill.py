"""``python -m kt_kernel cache PATH --dir DIR``: fill an ``mmap_experts_dir`` ahead of a launch.

Every MoE layer of the model at PATH (a GGUF model, a directory ``kt-kernel convert`` wrote, or a
Hugging Face directory as it ships) is loaded once through the cache, as a launch with the same
options would load it (kt_kernel.expert_cache): a layer whose files are there and good is mapped and
left as it is, any other is packed and written. A later launch maps the files only where its key is
the same: the same model files, method, build, ``threadpool_count`` and, with
``skip_gpu_expert_cpu_copy=True``, the same experts on the GPU (this command fills the key of a launch
holding every expert in CPU memory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .checkpoint import read_manifest
from .gguf_file import GGUF_FORMAT, GGUFModel, is_gguf_checkpoint
from .memory_estimate import GGUF_EXPERTS
from .safetensors_io import CheckpointError, index_checkpoint
from .sources import ExpertSource, stored_format

#: A layer of the model: its index, experts, hidden and intermediate size, and the method a launch
#: reads it with unless told another.
Layer = tuple[int, int, int, int, str]


def moe_layers(path: str | Path) -> list[Layer]:
    """The model's MoE layers, from headers only. CheckpointError for a path that is no model this
    package reads, or one without routed experts."""
    path = Path(path)
    layers: list[Layer] = []
    if is_gguf_checkpoint(path):
        for name, (_, tensor) in GGUFModel(path).tensors.items():
            match = GGUF_EXPERTS.match(name)
            if match and match["projection"] == "gate":
                experts, inter, hidden = (int(d) for d in reversed(tensor.shape.tolist()))
                layers.append((int(match["layer"]), experts, hidden, inter, GGUF_FORMAT))
    elif not path.is_dir():
        raise CheckpointError(f"{path}: neither a .gguf file nor a model directory")
    elif (manifest := read_manifest(path)) is not None:
        for index, entry in manifest["layers"].items():
            layers.append(
                (int(index), entry["experts"], entry["hidden"], entry["intermediate"], manifest["format"])
            )
    else:
        source = ExpertSource(path, index_checkpoint(path))
        with source.opened():
            for index in source.experts:
                layer = source.describe(index)
                method = stored_format(layer.dtypes).name
                layers.append((index, layer.experts, layer.hidden, layer.intermediate, method))
    if not layers:
        raise CheckpointError(f"{path}: no routed experts found")
    return sorted(layers)


def fill(
    path: str | Path,
    directory: str | Path,
    method: str | None = None,
    layers: list[range] | None = None,
    threads: int = 1,
    threadpool_count: int = 1,
    report: Callable[[str], None] = print,
) -> dict[str, int]:
    """Load each MoE layer of ``path`` (or those in ``layers``) through the cache ``directory``;
    returns how many layers were written and how many were there already."""
    from .experts import KTMoEWrapper

    found = moe_layers(path)
    if layers is not None:
        found = [layer for layer in found if any(layer[0] in r for r in layers)]
        if not found:
            raise ValueError(f"{path}: none of the layers asked for holds routed experts")
    counts = {"written": 0, "present": 0}
    for index, experts, hidden, inter, default_method in found:
        start = time.perf_counter()
        moe = KTMoEWrapper(
            layer_idx=index, num_experts=experts, num_experts_per_tok=min(8, experts), hidden_size=hidden,
            moe_intermediate_size=inter, gpu_experts_mask=torch.zeros(experts, dtype=torch.bool),
            cpuinfer_threads=threads, threadpool_count=threadpool_count, weight_path=str(path),
            chunked_prefill_size=64, method=method or default_method, mmap_experts_dir=directory,
        )  # fmt: skip
        try:
            moe.load_weights()
            seconds = time.perf_counter() - start
            present = all(sp.engine.mapped for sp in moe._subpools)
            held = sum(sp.engine.packed_bytes() for sp in moe._subpools)
        finally:
            moe.close()
        counts["present" if present else "written"] += 1
        what = "mapped from the cache" if present else "packed and written"
        report(f"layer {index}: {experts} experts, {held / 2**20:.1f} MiB held, {what} in {seconds:.2f} s")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the model: a .gguf file or a model directory")
    parser.add_argument("--dir", required=True, metavar="DIR", help="the mmap_experts_dir to fill")
    parser.add_argument("--method", help="the method the launch will pass (default: the format of the files)")
    parser.add_argument("--layers", metavar="A-B,C", help="only these layers (default: every MoE layer)")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="cpuinfer_threads (default: all CPUs)",
    )
    parser.add_argument(
        "--threadpool-count", type=int, default=1, metavar="C",
        help="the launch's threadpool_count: the subpool split is part of the key (default 1)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from .convert import parse_layers

    try:
        layers = None if args.layers is None else parse_layers(args.layers)
        counts = fill(args.path, args.dir, args.method, layers, args.threads, args.threadpool_count)
    except (ValueError, NotImplementedError, ImportError) as error:  # CheckpointError is a ValueError
        print(f"kt-kernel cache: error: {error}", file=sys.stderr)
        return 2
    print(f"{args.dir}: {counts['written']} layers written, {counts['present']} already there")
    return 0
