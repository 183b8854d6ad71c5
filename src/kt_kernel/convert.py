"""``kt-kernel convert``: routed-expert weights of a Hugging Face checkpoint -> a converted checkpoint.

Input: a directory of ``.safetensors`` (with or without ``*.index.json``), experts in BF16, FP16,
FP32 or FP8 E4M3 with DeepSeek-style 128x128 block scales (``<key>_scale_inv``, fp32
``[ceil(N/128), ceil(K/128)]``; weight = fp8 value * the scale of its block). Expert namings,
found from the tensor names (any prefix before ``layers.{L}``, e.g. ``model.`` or
``model.language_model.``):

- ``layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (DeepSeek, Qwen);
- ``layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral, MiniMax; w1 = gate,
  w3 = up, w2 = down);
- ``layers.{L}.mlp.experts.{gate_up_proj,down_proj}``, fused, as transformers v5 models
  (Qwen3.5-MoE, Qwen3-MoE, GLM4-MoE) define and Qwen3.5-MoE checkpoints store them:
  ``gate_up_proj`` ``[E, 2I, H]`` whose rows ``[:I]`` are gate and ``[I:]`` up (the model computes
  ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)`` -> gate, up), ``down_proj`` ``[E, H, I]``.
  The transposed ``[E, H, 2I]`` variant of Llama4 / GPT-OSS (GPT-OSS also interleaves gate and
  up) is not read: it cannot be told apart from ``[E, 2I, H]`` when H = 2I.

Output, in OUTPUT_DIR: ``layer_{L:03d}.safetensors`` per layer with
``blk.{L}.ffn_{gate,up,down}_exps.weight`` (the format's values, ``[E, N, K...]``) and, except
BF16, ``blk.{L}.ffn_{gate,up,down}_exps.scale``; and ``kt_manifest.json`` (format, group size,
per-layer shapes and file, source, tool version). Every file is written under a temporary name
``.NAME.PID.tmp`` and renamed when complete, the manifest after each layer, so an interrupted run
leaves only complete layers behind; ``resume=True`` skips them. The files are deterministic: a
resumed run gives the bytes of an uninterrupted one. Each manifest update holds an exclusive
``flock`` on ``.kt_manifest.lock`` and merges this run's layers into the manifest as it is on disk,
so runs converting different layers into one OUTPUT_DIR at the same time all land their layers; a
run deletes only the temporary files of processes no longer alive. Peak memory is about one
layer's converted experts: the source is read and quantized one expert at a time.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError

from . import __version__, formats
from .checkpoint import MANIFEST_NAME, converted_file_name, read_manifest
from .formats import WeightFormat
from .gguf_file import expert_tensor_name
from .safetensors_io import CheckpointError, index_checkpoint, read_safetensors_header
from .sources import PROJECTIONS, ExpertSource, MoELayer
from .sources import dequantize_fp8_blocks as dequantize_fp8_blocks  # also kt_kernel.convert's name

LOCK_NAME = ".kt_manifest.lock"
_TEMPORARY = re.compile(r"^\.(?:layer_\d+\.safetensors|kt_manifest\.json)\.(?P<pid>\d+)\.tmp$")
_SAFETENSORS_DTYPES = {
    torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
}  # fmt: skip


def parse_layers(text: str) -> list[range]:
    """Layer ranges from ``A-B``, ``A`` or a comma list of both ("0-3,7" -> [range(0, 4), range(7, 8)]).
    Not expanded: a range such as 0-99999999 is checked against the model without being listed."""
    ranges = []
    for part in text.split(","):
        bounds = [bound.strip() for bound in part.split("-")]
        if len(bounds) > 2 or not all(bound.isascii() and bound.isdecimal() for bound in bounds):
            raise ValueError(f"--layers: {part!r} is not a layer or a range A-B")
        first, last = int(bounds[0]), int(bounds[-1])
        if last < first:
            raise ValueError(f"--layers: empty range {part!r}")
        ranges.append(range(first, last + 1))
    return ranges


def _ranges_text(numbers: Iterable[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    parts: list[list[int]] = []
    for number in sorted(numbers):
        if parts and number == parts[-1][1] + 1:
            parts[-1][1] = number
        else:
            parts.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _select_layers(requested: Iterable[int] | None, present: dict[int, int]) -> list[int]:
    """The requested layers, sorted; ValueError naming the first few that hold no experts."""
    if requested is None:
        return sorted(present)
    wanted, absent = set(), []
    for layer in requested:
        if layer in present:
            wanted.add(layer)
        else:
            absent.append(layer)
            if len(absent) > 5:
                break  # a range far beyond the model is refused without walking it to its end
    if absent:
        listed = ", ".join(map(str, absent[:5])) + (", ..." if len(absent) > 5 else "")
        raise ValueError(f"layers [{listed}] hold no routed experts (MoE layers: {_ranges_text(present)})")
    return sorted(wanted)


class Progress:
    """A status line on stderr, rewritten in place on a terminal; one line per layer otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.live = enabled and sys.stderr.isatty()
        self._last = 0.0

    def expert(self, layer: MoELayer, expert: int) -> None:
        now = time.monotonic()
        if self.live and (now - self._last > 0.1 or expert + 1 == layer.experts):
            self._last = now
            head = f"[convert] layer {self.done + 1}/{self.total} (L{layer.index})"
            print(f"\r{head}: expert {expert + 1}/{layer.experts}", end="", file=sys.stderr, flush=True)

    def layer(self, layer: MoELayer, note: str) -> None:
        self.done += 1
        if self.enabled:
            head = f"[convert] layer {self.done}/{self.total} (L{layer.index})"
            print(("\r" if self.live else "") + f"{head}: {note}", file=sys.stderr, flush=True)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file whose bytes depend only on its content. safetensors' own save_file orders
    the metadata differently from one process to the next, so a resumed run would differ."""
    # Larger elements first, as safetensors does: every tensor stays aligned to its element size.
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in names:
            f.write(tensors[name].contiguous().view(torch.uint8).numpy().data)


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary name in the same directory, then rename: a reader sees all or
    nothing. A failure (a full disk) removes the temporary file and is an OSError naming ``path``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except (OSError, SafetensorError) as error:
        temporary.unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {error}") from error
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (OverflowError, OSError):
        return False
    return True


def _remove_stale_temporaries(output: Path) -> None:
    """Delete the temporary files of runs that were killed while writing. Those of live processes
    are another run's files in progress, converting into the same OUTPUT_DIR."""
    for file in output.glob(".*.tmp"):
        match = _TEMPORARY.match(file.name)
        if match and (int(match["pid"]) == os.getpid() or not _pid_alive(int(match["pid"]))):
            file.unlink(missing_ok=True)


@contextmanager
def _manifest_lock(output: Path) -> Iterator[None]:
    """Exclusive among the processes converting into ``output``; released when the file is closed.
    The lock file stays: deleting it would let two runs lock two different files."""
    fd = os.open(output / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_output(output: Path, manifest: dict | None, fmt: str, source: Path) -> None:
    """ValueError when OUTPUT_DIR holds a conversion of another format or another source."""
    if manifest is not None and manifest.get("format") != fmt:
        raise ValueError(
            f"{output} already holds {manifest.get('format')} weights ({MANIFEST_NAME}); "
            f"use --format {str(manifest.get('format')).lower()} or another OUTPUT_DIR"
        )
    if manifest is not None and manifest.get("source") != str(source):
        raise ValueError(f"{output} holds a conversion of {manifest.get('source')}, not of {source}")


def _record_layers(output: Path, header: dict, entries: dict[str, dict]) -> dict:
    """Add ``entries`` to the manifest as it is on disk now (other runs may have added layers since
    this one started) and write it, under the lock. Returns the manifest written."""
    with _manifest_lock(output):
        on_disk = read_manifest(output)
        _check_output(output, on_disk, header["format"], Path(header["source"]))
        manifest = dict(header)
        if on_disk is not None:
            if on_disk.get("group_size") != header.get("group_size"):
                raise ValueError(f"{output}: another run wrote group size {on_disk.get('group_size')}")
            theirs = on_disk.get("source_dtype")
            dtypes = set(header["source_dtype"].split(",")) | set(
                theirs.split(",") if isinstance(theirs, str) else []
            )
            manifest["source_dtype"] = ",".join(sorted(dtypes - {""}))
        layers = {**(on_disk["layers"] if on_disk else {}), **entries}
        manifest["layers"] = dict(sorted(layers.items(), key=lambda item: int(item[0])))
        text = json.dumps(manifest, indent=2) + "\n"
        _write_atomically(output / MANIFEST_NAME, lambda tmp: tmp.write_text(text))
    return manifest


def _layer_is_complete(output: Path, done: dict, layer: MoELayer, fmt: str) -> bool:
    """Listed in ``done`` (the manifest's layers) with the same shapes, and its file is there,
    readable, of this format."""
    entry = done.get(str(layer.index))
    shapes = {"experts": layer.experts, "hidden": layer.hidden, "intermediate": layer.intermediate}
    if entry is None or any(entry.get(key) != value for key, value in shapes.items()):
        return False
    try:
        metadata = read_safetensors_header(output / entry["file"]).metadata
    except CheckpointError:
        return False
    return metadata.get("format") == fmt and metadata.get("layer") == str(layer.index)


def _convert_layer(
    source: ExpertSource, layer: MoELayer, fmt: WeightFormat, group_size: int | None, progress: Progress
) -> dict[str, torch.Tensor]:
    """Quantize a layer expert by expert into stacked [E, ...] tensors named blk.{L}.ffn_*_exps.*.
    FP8 sources converted to FP8 are copied as they are (their scales put in the canonical layout)
    where their 128 x 128 scale blocks fit whole along K (H and I multiples of 128); elsewhere they
    are quantized again from the values they mean, like any other source."""
    out: dict[str, torch.Tensor] = {}
    fits = layer.hidden % formats.FP8_BLOCK == 0 and layer.intermediate % formats.FP8_BLOCK == 0
    copy = fmt is formats.FP8 and "F8_E4M3" in layer.dtypes and fits
    for expert in range(layer.experts):
        weights = source.read_stored(layer, expert) if copy else source.read_expert(layer, expert)
        for p, projection in enumerate(PROJECTIONS):
            where = source.describe_weight(p, layer.index, expert)
            try:
                if copy:
                    codes, scale = weights[p]
                    values, scales = formats.FP8.stored(where, codes, f"{where} scale", scale)
                else:
                    values, scales = fmt.quantize(weights[p], group_size)
            except ValueError as error:  # the sizes were checked: this is the data (NaN, Inf)
                raise CheckpointError(f"tensor {where} cannot be converted: {error}") from error
            for kind, tensor in (("weight", values), ("scale", scales)):
                if tensor is None:
                    continue
                name = expert_tensor_name(layer.index, projection, kind)  # GGUF's names
                if name not in out:
                    out[name] = torch.empty((layer.experts, *tensor.shape), dtype=tensor.dtype)
                out[name][expert] = tensor
        progress.expert(layer, expert)
    return out


def _choose_group_size(
    fmt: WeightFormat, group_size: int | None, layers: list[MoELayer], manifest: dict | None
) -> int | None:
    """Where the format offers a choice of scale group (INT4): the given group size, else the one
    OUTPUT_DIR already holds, else the largest allowed dividing H and I of every layer. Other
    formats take none."""
    if not fmt.group_choice:
        if group_size is not None:
            choosing = " and ".join(formats.GROUP_CHOICE).lower()
            raise ValueError(f"--group-size applies to {choosing} only, not {fmt.name.lower()}")
        return None
    previous = manifest.get("group_size") if manifest else None
    if group_size is not None and previous is not None and group_size != previous:
        raise ValueError(f"OUTPUT_DIR holds {fmt.name} weights with group size {previous}, not {group_size}")
    group_size = group_size or previous
    if group_size is not None and group_size not in fmt.scale_groups:
        raise ValueError(f"--group-size must be one of {fmt.scale_groups}, got {group_size}")
    sizes = math.gcd(*(size for layer in layers for size in (layer.hidden, layer.intermediate)))
    if group_size is not None and sizes % group_size:
        raise ValueError(
            f"{fmt.name} group size {group_size} does not divide the hidden and intermediate sizes"
        )
    return group_size or fmt.choose_group(sizes)


def convert_checkpoint(
    input_dir: str | Path,
    output_dir: str | Path,
    method: str,
    *,
    group_size: int | None = None,
    layers: Iterable[int] | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Convert the routed experts of ``input_dir`` into ``output_dir`` (see the module docstring).

    ``method``: a registered format (kt_kernel.formats.FORMATS) or an alias such as AMXINT4;
    ``layers``: a subset of the layer indices (default: all MoE layers); ``resume``: skip layers
    already complete in ``output_dir``. Returns the manifest. Raises CheckpointError (a ValueError)
    for unreadable, incomplete or non-finite input, ValueError for a conflicting OUTPUT_DIR or
    impossible options, OSError naming the file when OUTPUT_DIR cannot be written (a full disk).
    """
    fmt = formats.get(method)
    source_path, output = Path(input_dir).resolve(), Path(output_dir).resolve()
    if source_path == output:
        raise ValueError("OUTPUT_DIR must differ from INPUT_DIR")
    source = ExpertSource(source_path, index_checkpoint(source_path))
    wanted = _select_layers(layers, source.experts)
    with source.opened():
        todo = [source.describe(layer) for layer in wanted]  # every key and shape checked before writing
    for layer in todo:
        try:
            fmt.check_dimensions({"hidden": layer.hidden, "intermediate": layer.intermediate})
        except ValueError as error:
            raise ValueError(f"layer {layer.index}: {error}") from None
    manifest = read_manifest(output) if output.is_dir() else None
    _check_output(output, manifest, fmt.name, source_path)
    group_size = _choose_group_size(fmt, group_size, todo, manifest)
    output.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(output)
    dtypes = set().union(*(layer.dtypes for layer in todo))
    header = {
        "tool": "kt-kernel convert",
        "kt_kernel_version": __version__,
        "format": fmt.name,
        **({"group_size": group_size} if group_size else {}),
        "source": str(source_path),
        "source_dtype": ",".join(sorted(dtypes)),
        "naming": source.naming.name,
        "source_prefix": source.prefix,
    }
    done = manifest["layers"] if manifest else {}
    bar = Progress(len(todo), progress)
    for layer in todo:
        if resume and _layer_is_complete(output, done, layer, fmt.name):
            bar.layer(layer, "already converted, skipped")
            continue
        start = time.monotonic()
        with source.opened():
            tensors = _convert_layer(source, layer, fmt, group_size, bar)
        file = converted_file_name(layer.index)
        metadata = {"format": fmt.name, "layer": str(layer.index), "experts": str(layer.experts)}
        _write_atomically(output / file, lambda tmp, t=tensors, m=metadata: write_safetensors(t, tmp, m))
        del tensors
        entry = {
            "file": file,
            "experts": layer.experts,
            "hidden": layer.hidden,
            "intermediate": layer.intermediate,
        }
        _record_layers(output, header, {str(layer.index): entry})
        bar.layer(layer, f"{layer.experts} experts in {time.monotonic() - start:.1f} s -> {file}")
    return _record_layers(output, header, {})  # also when every layer was skipped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``convert`` subcommand's arguments."""
    parser.add_argument("input_dir", help="Hugging Face-style model directory of .safetensors")
    parser.add_argument("output_dir", help="directory for layer_LLL.safetensors and kt_manifest.json")
    choices = list(formats.FORMATS)
    parser.add_argument("--format", required=True, type=str.upper, choices=choices, help="|".join(choices))
    offered = "; ".join(
        f"{name}: {', '.join(str(g) for g in formats.get(name).scale_groups if g)}"
        for name in formats.GROUP_CHOICE
    )
    parser.add_argument("--group-size", type=int, help=f"{offered} (default: the largest that fits)")
    parser.add_argument("--layers", type=parse_layers, help="layers to convert: A-B, A, or a list like 0-3,7")
    parser.add_argument("--resume", action="store_true", help="skip layers already complete in OUTPUT_DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args: argparse.Namespace) -> int:
    """Run ``kt-kernel convert``; a bad input or OUTPUT_DIR is one line on stderr and exit status 1."""
    layers = None if args.layers is None else itertools.chain.from_iterable(args.layers)
    try:
        manifest = convert_checkpoint(
            args.input_dir, args.output_dir, args.format,
            group_size=args.group_size, layers=layers, resume=args.resume, progress=not args.quiet,
        )  # fmt: skip
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        print(f"kt-kernel convert: error: {error}", file=sys.stderr)
        return 1
    print(f"{len(manifest['layers'])} layers of {manifest['format']} experts in {args.output_dir}")
    return 0
