"""Expert weights from safetensors checkpoints.

DeepSeek-V4-Flash layout (MXFP4 experts), optionally under a ``model.`` prefix:
``layers.{L}.ffn.experts.{e}.{w1,w3,w2}.{weight,scale}`` with w1 = gate, w3 = up, w2 = down;
weight I8 ``[N, K/2]`` (two E2M1 codes per byte), scale F8_E8M0 or U8 ``[N, K/32]``.
Files are found through ``*.index.json`` when there is one, else by reading every
``*.safetensors`` header. Only the requested layer is read, tensor by tensor. Every file's header
is validated (read_safetensors_header) before safetensors opens it, and anything but a regular
file is refused unopened: a bad file is a CheckpointError naming it, never a hang.

Converted layout (written by ``kt-kernel convert``, see kt_kernel.convert): a directory with
``kt_manifest.json`` and one ``layer_{L:03d}.safetensors`` per layer holding
``blk.{L}.ffn_{gate,up,down}_exps.{weight,scale}`` in the format's canonical layout.

Hugging Face source checkpoints (what ``kt-kernel convert`` reads): ExpertSource finds the routed
experts by one of NAMINGS and reads them one expert at a time, FP8 block-scaled weights dequantized.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from . import formats

V4_FLASH_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}
#: The format DeepSeek-V4-Flash ships its routed experts in: loaded without conversion.
V4_FLASH_FORMAT = "MXFP4"
MANIFEST_NAME = "kt_manifest.json"
PROJECTIONS = ("gate", "up", "down")


def converted_file_name(layer: int) -> str:
    """The file of one layer in a converted checkpoint."""
    return f"layer_{layer:03d}.safetensors"


def converted_tensor_name(layer: int, projection: str, kind: str) -> str:
    """``blk.{L}.ffn_{gate,up,down}_exps.{weight,scale}``: a converted layer's tensor names."""
    return f"blk.{layer}.ffn_{projection}_exps.{kind}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: missing files or tensors, corrupt data."""


#: safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
#: An index or manifest larger than this is refused rather than read into memory.
MAX_JSON_BYTES = 64 << 20
#: Bits per element of every safetensors dtype.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}  # fmt: skip


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: ``tensors`` maps each name to (dtype, shape)."""

    tensors: dict[str, tuple[str, list[int]]]
    metadata: dict[str, str]


def _open_regular(file: Path) -> BinaryIO:
    """``file`` opened for reading; CheckpointError for anything but a regular file. Checked by
    stat before opening, since opening a FIFO for reading blocks until a writer comes."""
    try:
        mode = os.stat(file).st_mode
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the name
        raise CheckpointError(f"{file}: cannot open ({error})") from error
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{file}: not a regular file")
    try:
        # O_NONBLOCK: should a FIFO replace the file after the stat, opening it still returns at once.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise CheckpointError(f"{file}: cannot open ({error})") from error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{file}: not a regular file")
    return os.fdopen(fd, "rb")


def _read_json(file: Path) -> object:
    """The JSON value of a regular file of at most MAX_JSON_BYTES bytes."""
    limit = MAX_JSON_BYTES
    with _open_regular(file) as f:
        try:
            data = f.read(limit + 1)
        except OSError as error:
            raise CheckpointError(f"{file}: cannot read ({error})") from error
    if len(data) > limit:
        raise CheckpointError(f"{file}: larger than {limit} bytes, not read")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from error


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a name appears twice")
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _element_bits(shape: list[int], dtype: str, limit: int) -> int:
    """prod(shape) * the dtype's bits, stopping once past ``limit`` (a shape of huge dimensions
    would otherwise make a huge integer)."""
    if 0 in shape:
        return 0
    bits = DTYPE_BITS[dtype]
    for dim in shape:
        bits *= dim
        if bits > limit:
            break
    return bits


def read_safetensors_header(file: str | Path) -> SafetensorsHeader:
    """The header of a safetensors file, checked without reading the data: a regular file, an
    8-byte little-endian length within MAX_HEADER_BYTES and the file, a JSON object whose tensors
    have known dtypes and data offsets inside the data section, not overlapping, spanning exactly
    prod(shape) elements. CheckpointError naming the file otherwise."""
    file = Path(file)

    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{file}: not a valid safetensors file ({reason})")

    with _open_regular(file) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the header length field")
            length = int.from_bytes(prefix, "little")
            if length > MAX_HEADER_BYTES:
                raise bad(f"header length {length} exceeds {MAX_HEADER_BYTES} bytes")
            if 8 + length > size:
                raise bad(f"header length {length} runs past the end of the file ({size} bytes)")
            raw = f.read(length)
        except OSError as error:
            raise CheckpointError(f"{file}: cannot read ({error})") from error
    if len(raw) != length:
        raise bad("the file shrank while being read")
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise bad(f"header is not valid JSON: {error}") from error
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not a map of strings")
    data_size = size - 8 - length
    tensors, spans = {}, []
    for name, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(shape, list)
            or not all(_is_int(dim) for dim in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(offset) for offset in offsets)
        ):
            raise bad(f"tensor {name!r} has no valid shape and data_offsets")
        dtype = info.get("dtype")
        if dtype not in DTYPE_BITS:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
        begin, end = offsets
        if not begin <= end <= data_size:
            raise bad(f"tensor {name!r} has data offsets {offsets} outside the {data_size}-byte data section")
        if _element_bits(shape, dtype, 8 * data_size) != 8 * (end - begin):
            raise bad(f"tensor {name!r}: {dtype} {shape} does not fill its {end - begin} bytes")
        tensors[name] = (dtype, shape)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise bad(f"tensors {first!r} and {second!r} overlap")
    return SafetensorsHeader(tensors, metadata)


def _shard_path(directory: Path, index: Path, name: str) -> Path:
    """The shard an index entry names, which must lie inside the checkpoint directory. Checked
    on the name, not the resolved path: a Hugging Face cache holds its shards as symlinks into
    a directory beside the checkpoint."""
    normalized = os.path.normpath(name)
    if not name or os.path.isabs(name) or normalized in (".", "..") or normalized.startswith("../"):
        raise CheckpointError(f"{index}: weight_map entry {name!r} is not a file inside {directory}")
    return directory / normalized


def _read_index(index: Path) -> dict[str, Path]:
    """Tensor name -> shard of one ``*.index.json``; every shard must be a regular file."""
    content = _read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map' of tensor name -> file)")
    files: dict[str, Path] = {}
    shards: dict[str, Path] = {}
    for key, name in weight_map.items():
        if name not in shards:
            shards[name] = _shard_path(index.parent, index, name)
            try:
                mode = os.stat(shards[name]).st_mode
            except (OSError, ValueError) as error:
                raise CheckpointError(
                    f"{index} names the shard {shards[name]}, which cannot be read ({error})"
                ) from error
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{index} names the shard {shards[name]}, which is not a regular file")
        files[key] = shards[name]
    return files


def index_checkpoint(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint directory (or single file) to the file holding it."""
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json")) or sorted(path.glob("*.index.json"))
        if indexes:
            return {key: file for index in indexes for key, file in _read_index(index).items()}
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no .safetensors files in {path}")
        return {key: shard for shard in shards for key in read_safetensors_header(shard).tensors}
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    return {key: path for key in read_safetensors_header(path).tensors}


class TensorReader:
    """Reads tensors by name from an indexed checkpoint, keeping each file open once. Every file
    is checked by read_safetensors_header before safetensors opens it."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self.files, self._stack = files, stack
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._open: dict[Path, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The tensor ``key``, or only its ``index``-th entry along the first dimension."""
        return self._access(key, lambda f: f.get_tensor(key) if index is None else f.get_slice(key)[index])

    def header(self, key: str) -> tuple[str, list[int]]:
        """The tensor's safetensors dtype ("BF16", "F8_E4M3", ...) and shape; no data is read."""
        return self._checked_header(key).tensors[key]

    def _checked_header(self, key: str) -> SafetensorsHeader:
        if key not in self.files:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        file = self.files[key]
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        if key not in self._headers[file].tensors:
            raise CheckpointError(f"{file}: holds no tensor {key!r}, though the index names it there")
        return self._headers[file]

    def _access(self, key: str, action: Callable[[Any], Any]) -> Any:
        self._checked_header(key)
        file = self.files[key]
        try:
            if file not in self._open:
                self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            return action(self._open[file])
        except Exception as error:  # safetensors and torch raise assorted types for bad data
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({error})") from error


#: Which experts of a layer the readers return: experts 0..n-1, or a range of them.
Experts = int | range


def _expert_range(experts: Experts) -> range:
    return range(experts) if isinstance(experts, int) else experts


def read_v4_flash_experts(
    path: str | Path, layer: int, experts: Experts, files: dict[str, Path] | None = None
) -> dict[str, torch.Tensor]:
    """MXFP4 experts of one layer as canonical uint8 tensors: gate/up/down [E, N, K/2] and
    gate_scale/up_scale/down_scale [E, N, K/32] (the keyword names of load_weights_from_tensors).
    ``files``: the checkpoint's index_checkpoint, where the caller has it already."""
    experts = _expert_range(experts)
    files = files if files is not None else index_checkpoint(path)
    prefix = "model." if f"model.layers.{layer}.ffn.experts.0.w1.weight" in files else ""
    result: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = TensorReader(files, stack)
        for name, short in V4_FLASH_PROJECTIONS.items():
            for kind, out_name in (("weight", name), ("scale", f"{name}_scale")):
                stacked = None
                for index, expert in enumerate(experts):
                    key = f"{prefix}layers.{layer}.ffn.experts.{expert}.{short}.{kind}"
                    tensor = reader.read(key)
                    if tensor.dtype not in (torch.int8, torch.uint8, torch.float8_e8m0fnu):
                        raise CheckpointError(
                            f"tensor {key!r} has dtype {tensor.dtype}, expected I8/U8/F8_E8M0"
                        )
                    if stacked is None:
                        stacked = torch.empty((len(experts), *tensor.shape), dtype=torch.uint8)
                    elif tuple(tensor.shape) != tuple(stacked.shape[1:]):
                        raise CheckpointError(
                            f"tensor {key!r} has shape {list(tensor.shape)}, "
                            f"but expert {experts.start} has {list(stacked.shape[1:])}"
                        )
                    stacked[index] = tensor.view(torch.uint8)
                result[out_name] = stacked
    return result


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a converted checkpoint directory, or None where the directory has none.
    CheckpointError, naming the manifest, for one that is not a regular file or not well formed."""
    file = Path(path) / MANIFEST_NAME
    if not os.path.lexists(file):
        return None
    manifest = _read_json(file)
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, dict) or not isinstance(manifest.get("format"), str):
        raise CheckpointError(f"{file}: not a kt-kernel manifest (no 'format' and 'layers' table)")
    for layer, entry in layers.items():
        ok = layer.isdecimal() and isinstance(entry, dict) and isinstance(entry.get("file"), str)
        # The file is a plain name: a manifest cannot send the loader outside its directory.
        if not ok or entry["file"] != Path(entry["file"]).name or entry["file"] in ("", ".", ".."):
            raise CheckpointError(f"{file}: layer {layer!r} has no valid file entry")
        if not all(_is_int(entry.get(size)) for size in ("experts", "hidden", "intermediate")):
            raise CheckpointError(f"{file}: layer {layer!r} lacks integer experts, hidden, intermediate")
    return manifest


def read_converted_layer(
    path: str | Path, layer: int, experts: Experts, method: str
) -> dict[str, torch.Tensor]:
    """Experts 0..experts-1 (or the range ``experts``) of one layer of a converted checkpoint
    (``kt-kernel convert``).

    Returns gate/up/down and, except for BF16, gate_scale/up_scale/down_scale: the arguments of
    KTMoEWrapper.load_weights_from_tensors. ValueError when ``method`` means another format than
    the checkpoint holds; CheckpointError for a missing layer, too few experts or a bad file.
    """
    experts = _expert_range(experts)
    fmt = formats.get(method)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path} holds no {MANIFEST_NAME}: not a converted checkpoint")
    held = manifest.get("format")
    if held != fmt.name:
        raise ValueError(
            f"{path} holds {held} weights, but method {method!r} needs {fmt.name}; "
            f"convert again with --format {fmt.name.lower()} or pass method={held!r}"
        )
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        done = ", ".join(sorted(manifest["layers"], key=int)) or "none"
        raise CheckpointError(f"layer {layer} is not in the converted checkpoint {path} (layers: {done})")
    if experts.stop > entry["experts"]:
        raise CheckpointError(f"layer {layer} of {path} has {entry['experts']} experts, {experts.stop} asked")
    file = Path(path) / entry["file"]
    header = read_safetensors_header(file)
    if header.metadata.get("format") != fmt.name:
        raise CheckpointError(f"{file}: holds {header.metadata.get('format')} weights, not {fmt.name}")
    names = {
        projection + ("" if kind == "weight" else f"_{kind}"): converted_tensor_name(layer, projection, kind)
        for projection in PROJECTIONS
        for kind in fmt.tensor_kinds
    }
    for name in names.values():
        shape = header.tensors[name][1] if name in header.tensors else None
        if not shape or shape[0] != entry["experts"]:
            raise CheckpointError(
                f"{file}: tensor {name!r} is missing or does not hold {entry['experts']} experts"
            )
    try:
        with safe_open(file, framework="pt") as f:
            return {out: f.get_slice(name)[experts.start : experts.stop] for out, name in names.items()}
    except Exception as error:  # safetensors and torch raise assorted types for bad data
        raise CheckpointError(f"{file}: cannot read layer {layer} ({error})") from error


def read_layer(path: str | Path, layer: int, experts: Experts, method: str) -> dict[str, torch.Tensor]:
    """Experts 0..experts-1 (or the range ``experts``) of one layer of a checkpoint directory, as the
    keyword arguments of KTMoEWrapper.load_weights_from_tensors: a converted checkpoint in the
    method's format, one in the DeepSeek-V4-Flash layout (MXFP4), or a Hugging Face model directory
    as it ships (BF16, FP8, INT4)."""
    return LayerReader(path, layer, method).read(experts)


class LayerReader:
    """Reads the experts of one layer of a checkpoint directory (as read_layer), a range at a time:
    the directory is indexed, and a Hugging Face directory's layer found and checked, once, not per
    range (a big model's index holds ~100k tensor names)."""

    def __init__(
        self, path: str | Path, layer: int, method: str, sizes: tuple[int, int] | None = None
    ) -> None:
        """``sizes``: the (hidden, intermediate) the caller's layer has; a Hugging Face directory's
        layer of other sizes is refused here, from the headers, before any expert is read."""
        self.path, self.layer, self.method = path, layer, method
        self._files: dict[str, Path] | None = None
        self._source: tuple[ExpertSource, MoELayer] | None = None
        self._converted = read_manifest(path) is not None
        if self._converted:
            return
        fmt = formats.get(method)
        if fmt.name == V4_FLASH_FORMAT:
            self._files = index_checkpoint(path)
        else:
            self._source = _source_layer(path, layer, fmt)
            described = self._source[1]
            if sizes is not None and (described.hidden, described.intermediate) != tuple(sizes):
                raise CheckpointError(
                    f"{path} layer {layer}: experts of hidden size {described.hidden} and intermediate size "
                    f"{described.intermediate}, the layer has {sizes[0]} and {sizes[1]}"
                )

    def read(self, experts: Experts) -> dict[str, torch.Tensor]:
        if self._converted:
            return read_converted_layer(self.path, self.layer, experts, self.method)
        if self._files is not None:
            return read_v4_flash_experts(self.path, self.layer, experts, self._files)
        assert self._source is not None
        return _read_source_experts(*self._source, experts)


def read_source_layer(
    path: str | Path, layer: int, experts: Experts, fmt: formats.WeightFormat
) -> dict[str, torch.Tensor]:
    """One layer of a Hugging Face model directory, tensor by tensor, stored values as they are:
    BF16 (F16, F32) weights; FP8 codes with their scales (``weight_scale_inv`` per 128 x 128 block,
    or ``weight_scale`` per output channel); INT4 as compressed-tensors packs it (``weight_packed``,
    RAWINT4) or GPTQ does (``qweight``), as INT4 values, scales and (asymmetric GPTQ) zero points.
    ValueError when the weights on disk are not in ``fmt``; NotImplementedError for a format this
    reader does not take from a source directory."""
    return _read_source_experts(*_source_layer(path, layer, fmt), experts)


def _source_layer(path: str | Path, layer: int, fmt: formats.WeightFormat) -> tuple[ExpertSource, MoELayer]:
    """The experts of one layer of a Hugging Face model directory, found and checked (headers only)."""
    if fmt.name not in _SOURCE_FORMATS:
        raise NotImplementedError(
            f"{fmt.name} weights are read from converted checkpoints: convert {path} first with "
            f"`kt-kernel convert {path} OUTPUT_DIR --format {fmt.name.lower()}`"
        )
    source = ExpertSource(Path(path), index_checkpoint(path))
    with source.opened():
        if layer not in source.experts:
            raise CheckpointError(f"{path} holds no routed experts of layer {layer}")
        described = source.describe(layer)
    dtypes = described.dtypes
    on_disk = "FP8" if _FP8_DTYPE in dtypes else "INT4" if _INT4_DTYPE in dtypes else "BF16"
    if on_disk != fmt.name:
        stored = ", ".join(sorted(described.dtypes))
        raise ValueError(f"{path} layer {layer} holds {on_disk} experts ({stored}), not {fmt.name}")
    return source, described


def _read_source_experts(
    source: ExpertSource, described: MoELayer, experts: Experts
) -> dict[str, torch.Tensor]:
    experts = _expert_range(experts)
    if described.experts < experts.stop:
        raise CheckpointError(
            f"{source.path} layer {described.index} holds {described.experts} experts, not {experts.stop}"
        )
    result: dict[str, torch.Tensor] = {}
    with source.opened():
        for index, expert in enumerate(experts):
            for name, tensors in zip(PROJECTIONS, source.read_stored(described, expert), strict=True):
                for out, tensor in zip((name, f"{name}_scale", f"{name}_zeros"), tensors, strict=False):
                    if index == 0:
                        result[out] = torch.empty((len(experts), *tensor.shape), dtype=tensor.dtype)
                    result[out][index] = tensor
    for name in PROJECTIONS:  # symmetric GPTQ: plain INT4, for the kernels without zero points
        if f"{name}_zeros" in result and not result[f"{name}_zeros"].any():
            del result[f"{name}_zeros"]
    return result


# ---- Hugging Face source checkpoints (read by kt-kernel convert) ---------------------------------
FP8_BLOCK = 128
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_FP8_DTYPE = "F8_E4M3"
_SOURCE_FORMATS = ("BF16", "FP8", "INT4")  # what read_source_layer takes from a Hugging Face directory
_PREFIX = r"^(?P<prefix>(?:[\w-]+\.)*?)layers\.(?P<layer>\d+)\."
# A weight, or the packed INT4 of compressed-tensors (Kimi-K2-Thinking) or of GPTQ.
_WEIGHT_SUFFIX = r"(?:weight|weight_packed|qweight)$"
_INT4_DTYPE = "I4"  # how MoELayer.dtypes names INT4 sources (their tensors are I32)


@dataclass(frozen=True)
class Naming:
    """How a checkpoint names its experts; ``keys`` are gate, up, down key templates."""

    name: str
    pattern: re.Pattern[str]
    keys: tuple[str, str, str]
    fused: bool = False


_PER_EXPERT = "{prefix}layers.{layer}.%s.experts.{expert}.%s.weight"
_FUSED = "{prefix}layers.{layer}.mlp.experts.%s"
NAMINGS = (
    Naming(
        "mlp.experts.{e}.{gate,up,down}_proj",
        re.compile(_PREFIX + r"mlp\.experts\.(?P<expert>\d+)\.(?:gate|up|down)_proj\." + _WEIGHT_SUFFIX),
        tuple(_PER_EXPERT % ("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")),
    ),
    Naming(
        "block_sparse_moe.experts.{e}.{w1,w3,w2}",
        re.compile(_PREFIX + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w[123]\." + _WEIGHT_SUFFIX),
        tuple(_PER_EXPERT % ("block_sparse_moe", p) for p in ("w1", "w3", "w2")),
    ),
    Naming(
        "mlp.experts.{gate_up_proj,down_proj} (fused)",
        re.compile(_PREFIX + r"mlp\.experts\.(?:gate_up_proj|down_proj)$"),
        (_FUSED % "gate_up_proj", _FUSED % "gate_up_proj", _FUSED % "down_proj"),
        fused=True,
    ),
)


@dataclass(frozen=True)
class MoELayer:
    """One layer's routed experts: E experts, gate/up [I, H], down [H, I]; dtypes as stored."""

    index: int
    experts: int
    hidden: int
    intermediate: int
    dtypes: frozenset[str]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK):
    """FP8 ``[N, K]`` times one fp32 scale per ``block x block`` tile (``[ceil(N/b), ceil(K/b)]``),
    as float32: DeepSeek's ``weight_scale_inv`` is a multiplier despite its name."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return weight.float() * scale


def gptq_to_int4(
    name: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    zero_offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit GPTQ weight -> canonical INT4 (values [N, K/2], scales [N, K/G] float32, zero points
    [N, K/G] int8, all 0 when symmetric): qweight int32 [K/8, N] and qzeros int32 [K/G, N/8] pack
    eight 4-bit values along K (qweight) or N (qzeros), low bits first; w[n, k] = (q - z) * s with
    z = the stored zero + zero_offset, i.e. INT4 value q - 8 and zero point z - 8.
    NotImplementedError for an act-order g_idx (desc_act=True), which reorders the groups;
    CheckpointError for companions of other dtypes or shapes."""
    n, k = qweight.shape[1], 8 * qweight.shape[0]
    groups = scales.shape[0] if scales.dim() == 2 else 0
    expected = {
        "qweight": (qweight, (torch.int32,), (k // 8, n)),
        "qzeros": (qzeros, (torch.int32,), (groups, -(-n // 8))),
        "scales": (scales, (torch.float16, torch.bfloat16, torch.float32), (groups, n)),
    }
    if g_idx is not None:
        expected["g_idx"] = (g_idx, (torch.int32, torch.int64), (k,))
    for kind, (tensor, dtypes, shape) in expected.items():
        if tensor.dtype not in dtypes or tuple(tensor.shape) != shape:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"{name.removesuffix('weight')}{kind}: {str(tensor.dtype).removeprefix('torch.')} "
                f"{list(tensor.shape)}, expected {allowed} {list(shape)}"
            )
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (qweight.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
    q = q.reshape(-1, qweight.shape[1]).T  # [N, K]
    k, groups = q.shape[1], scales.shape[0]
    zeros = ((qzeros.to(torch.int32)[:, :, None] >> shifts) & 0xF).reshape(groups, -1)[:, : q.shape[0]]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise NotImplementedError(f"{name}: GPTQ with act-order (desc_act=True, a reordering g_idx)")
    nibbles = ((q - 8) & 0xF).to(torch.uint8)
    return (
        (nibbles[:, 0::2] | nibbles[:, 1::2] << 4).contiguous(),
        scales.float().T.contiguous(),
        (zeros + zero_offset - 8).to(torch.int8).T.contiguous(),
    )


def _require_float_scale(key: str, dtype: str) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {key!r} has dtype {dtype}; scales must be BF16, F16 or F32")


class ExpertSource:
    """The routed experts of a checkpoint, found by name and read one expert at a time."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path, self.files = path, files
        self.naming, self.prefix, self.experts = self._detect(files)
        self.reader: TensorReader

    @contextmanager
    def opened(self) -> Iterator[ExpertSource]:
        """Read inside this only. Files are memory-mapped while open and the pages read count in
        the process's RSS until they are closed: opening them per layer keeps that to one layer."""
        with ExitStack() as stack:
            self.reader = TensorReader(self.files, stack)
            yield self

    def _detect(self, keys: Iterable[str]) -> tuple[Naming, str, dict[int, int]]:
        groups: dict[tuple[Naming, str], dict[int, int]] = {}
        for key in keys:
            if ".experts." not in key:
                continue
            for naming in NAMINGS:
                match = naming.pattern.match(key)
                if match:
                    layers = groups.setdefault((naming, match["prefix"]), {})
                    count = 0 if naming.fused else int(match["expert"]) + 1  # fused: from the shape
                    layers[int(match["layer"])] = max(layers.get(int(match["layer"]), 0), count)
        if not groups:
            known = "; ".join(n.keys[0].format(prefix="", layer="L", expert="e") for n in NAMINGS)
            raise CheckpointError(f"no routed-expert tensors found in {self.path} (looked for: {known})")
        # A model may hold a few more MoE layers elsewhere (e.g. "mtp.layers.0..."): take the main stack.
        ranked = sorted(groups.items(), key=lambda item: -len(item[1]))
        if len(ranked) > 1 and len(ranked[0][1]) == len(ranked[1][1]):
            found = ", ".join(f"{prefix}layers.* ({naming.name})" for (naming, prefix), _ in ranked)
            raise CheckpointError(f"{self.path}: routed experts under several names, cannot choose: {found}")
        for (_, prefix), layers in ranked[1:]:
            print(f"[convert] ignoring {len(layers)} layers under {prefix}layers.*", file=sys.stderr)
        (naming, prefix), layers = ranked[0]
        return naming, prefix, layers

    def key(self, projection: int, layer: int, expert: int) -> str:
        return self.naming.keys[projection].format(prefix=self.prefix, layer=layer, expert=expert)

    def describe_weight(self, projection: int, layer: int, expert: int) -> str:
        """The checkpoint key of one expert's weight, for messages (fused: which part of it)."""
        key = repr(self.key(projection, layer, expert))
        return f"{key} (expert {expert}, {PROJECTIONS[projection]})" if self.naming.fused else key

    def describe(self, layer: int) -> MoELayer:
        """Check that every expert tensor of the layer exists with consistent shapes (headers only)."""
        if self.naming.fused:
            return self._describe_fused(layer)
        dtypes, shapes, stored_as = set(), {}, {}
        for expert in range(self.experts[layer]):
            for projection in range(3):
                key = self.key(projection, layer, expert)
                dtype, shape = self._checked_header(key)
                dtypes.add(dtype)
                expected = shapes.setdefault(projection, shape)
                if shape != expected:
                    raise CheckpointError(f"tensor {key!r} has shape {shape}, expert 0 has {expected}")
                # Float types may mix (each is read as it is); a quantized one may not: its codes and
                # scales would be read as another type's.
                first = stored_as.setdefault(projection, dtype)
                if dtype != first and {dtype, first} - set(_FLOAT_DTYPES):
                    raise CheckpointError(
                        f"tensor {key!r} is stored as {dtype}, expert 0's {PROJECTIONS[projection]} as "
                        f"{first}: the experts of a layer must share a quantized storage type"
                    )
        (inter, hidden), down = shapes[0], shapes[2]
        if shapes[1] != [inter, hidden] or down != [hidden, inter]:
            raise CheckpointError(
                f"layer {layer}: gate {shapes[0]}, up {shapes[1]}, down {down} are not [I, H], [I, H], [H, I]"
            )
        return MoELayer(layer, self.experts[layer], hidden, inter, frozenset(dtypes))

    def _describe_fused(self, layer: int) -> MoELayer:
        gate_up_dtype, gate_up = self.reader.header(self.key(0, layer, 0))
        down_dtype, down = self.reader.header(self.key(2, layer, 0))
        if gate_up_dtype not in _FLOAT_DTYPES or down_dtype not in _FLOAT_DTYPES:
            raise CheckpointError(  # no FP8 scale layout for fused experts is known to us
                f"layer {layer}: fused experts must be BF16, F16 or F32, got {gate_up_dtype}, {down_dtype}"
            )
        ok = len(gate_up) == len(down) == 3 and gate_up[0] == down[0]
        if not ok or gate_up[1] != 2 * down[2] or gate_up[2] != down[1]:
            raise CheckpointError(
                f"layer {layer}: fused gate_up_proj {gate_up} and down_proj {down} are not "
                "[E, 2I, H] and [E, H, I]"
            )
        self.experts[layer] = gate_up[0]
        return MoELayer(layer, gate_up[0], down[1], down[2], frozenset({gate_up_dtype, down_dtype}))

    def _checked_header(self, key: str) -> tuple[str, list[int]]:
        if key not in self.reader and self._int4_layout(key):
            return _INT4_DTYPE, self._int4_shape(key)
        dtype, shape = self.reader.header(key)
        if dtype == _FP8_DTYPE:
            scale_key, expected = self._fp8_scale(key, shape)
            scale_dtype, scale_shape = self.reader.header(scale_key)
            _require_float_scale(scale_key, scale_dtype)
            if scale_shape not in expected:
                shapes = " or ".join(map(str, expected))
                raise CheckpointError(
                    f"tensor {scale_key!r} has shape {scale_shape}, expected {shapes} "
                    f"(the scales of {key!r} {shape})"
                )
        elif dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {key!r} has dtype {dtype}; expected BF16, F16, F32 or F8_E4M3")
        if len(shape) != 2:
            raise CheckpointError(f"tensor {key!r} has shape {shape}, expected 2-D")
        return dtype, shape

    def _fp8_scale(self, key: str, shape: list[int]) -> tuple[str, list[list[int]]]:
        """The scale tensor of an FP8 weight and the shapes it may have: DeepSeek's
        ``weight_scale_inv`` per 128 x 128 block, or compressed-tensors' ``weight_scale`` per row."""
        if key + "_scale_inv" in self.reader or key + "_scale" not in self.reader:
            return key + "_scale_inv", [[-(-size // FP8_BLOCK) for size in shape]]
        return key + "_scale", [[shape[0], 1], [shape[0]]]

    def _int4_layout(self, key: str) -> str | None:
        """How the packed INT4 weight named like ``key`` (``....weight``) is stored, if it is."""
        base = key.removesuffix("weight")
        for layout, suffix in (("packed", "weight_packed"), ("gptq", "qweight")):
            if base + suffix in self.reader:
                return layout
        return None

    def _int4_shape(self, key: str) -> list[int]:
        """[N, K] of a packed INT4 weight, its companion tensors checked (headers only)."""
        base = key.removesuffix("weight")
        if self._int4_layout(key) == "packed":
            names, words = ("weight_packed", "weight_scale"), self.reader.header(base + "weight_packed")
            n, k = words[1][0], 8 * words[1][-1]
            scale_dtype, scale = self.reader.header(base + "weight_scale")
            rows, groups = scale if len(scale) == 2 else (None, None)
        else:
            names, words = ("qweight", "scales"), self.reader.header(base + "qweight")
            n, k = words[1][-1], 8 * words[1][0]
            scale_dtype, scale = self.reader.header(base + "scales")
            groups, rows = scale if len(scale) == 2 else (None, None)
        if words[0] != "I32" or len(words[1]) != 2:
            raise CheckpointError(f"tensor {base + names[0]!r} must be I32 [2-D], got {words[0]} {words[1]}")
        _require_float_scale(base + names[1], scale_dtype)
        shape_key = base + "weight_shape"  # compressed-tensors' own record of [N, K]: two integers
        if names[0] == "weight_packed" and shape_key in self.reader:
            declared = self.reader.read(shape_key)
            if declared.dtype.is_floating_point or declared.tolist() != [n, k]:
                raise CheckpointError(
                    f"tensor {shape_key!r} declares {declared.tolist()}, but {base + names[0]!r} holds "
                    f"[{n}, {k}]"
                )
        if rows != n or not groups or k % groups or k // groups not in formats.INT4.scale_groups:
            raise CheckpointError(
                f"tensor {base + names[1]!r} has shape {scale}: not one scale per 32, 64 or 128 of the "
                f"{k} inputs of each of the {n} rows"
            )
        return [n, k]

    def read_stored(self, layer: MoELayer, expert: int) -> list[tuple[torch.Tensor, ...]]:
        """Per projection of one expert, the weight as stored and, where it has them, its scales:
        FP8 (codes uint8, scales float32), INT4 (canonical INT4 values, scales float32 and, from
        GPTQ, zero points int8); float weights as (weight,)."""
        if self.naming.fused:
            return [(weight,) for weight in self.read_expert(layer, expert)]
        stored = []
        for projection in range(3):
            key = self.key(projection, layer.index, expert)
            if key not in self.reader and self._int4_layout(key):
                stored.append(self._read_int4(key))
                continue
            weight = self.reader.read(key)
            if weight.dtype != torch.float8_e4m3fn:
                stored.append((weight,))
                continue
            scale = self._read_scale(self._fp8_scale(key, list(weight.shape))[0])
            stored.append((weight.view(torch.uint8), scale))
        return stored

    def _read_int4(self, key: str) -> tuple[torch.Tensor, ...]:
        """A packed INT4 weight as canonical INT4: (two's complement nibbles [N, K/2], scales [N, K/G])
        and, from GPTQ, its zero points [N, K/G]."""
        base = key.removesuffix("weight")
        if self._int4_layout(key) == "packed":  # eight q + 8 per int32, low bits first
            words = self.reader.read(base + "weight_packed").contiguous()
            return words.view(torch.uint8) ^ 0x88, self._read_scale(base + "weight_scale")
        return gptq_to_int4(
            key,
            self.reader.read(base + "qweight"),
            self.reader.read(base + "qzeros"),
            self._read_scale(base + "scales"),
            self.reader.read(base + "g_idx") if base + "g_idx" in self.reader else None,
            self.gptq_zero_offset,
        )

    @functools.cached_property
    def gptq_zero_offset(self) -> int:
        """What GPTQ's stored zero points lack: 1 in the common "gptq" format, 0 in "gptq_v2"
        (``quantization_config.checkpoint_format`` of config.json). ValueError for bits other than 4."""
        config_file = self.path / "config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        quant = config.get("quantization_config", {}) if isinstance(config, dict) else {}
        quant = quant if isinstance(quant, dict) else {}
        if quant.get("bits", 4) != 4:
            raise ValueError(
                f"{config_file}: GPTQ bits = {quant.get('bits')!r}; only 4-bit GPTQ is supported"
            )
        return 0 if quant.get("checkpoint_format") == "gptq_v2" else 1

    def read_expert(self, layer: MoELayer, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate [I, H], up [I, H], down [H, I] of one expert, in the source's precision (FP8 and
        INT4 dequantized)."""
        if layer.dtypes & {_INT4_DTYPE}:
            return tuple(formats.INT4.dequantize(*stored) for stored in self.read_stored(layer, expert))
        if self.naming.fused:
            gate_up = self.reader.read(self.key(0, layer.index, 0), expert)
            down = self.reader.read(self.key(2, layer.index, 0), expert)
            return gate_up[: layer.intermediate], gate_up[layer.intermediate :], down
        return tuple(self._read_weight(self.key(p, layer.index, expert)) for p in range(3))

    def _read_scale(self, key: str) -> torch.Tensor:
        """A scale tensor as float32, refused unless every value is finite and positive."""
        scale = self.reader.read(key).float()
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise CheckpointError(
                f"tensor {key!r} holds the scale {scale[tuple(where)].item()} at index {where}: scales must "
                "be finite and positive"
            )
        return scale

    def _read_weight(self, key: str) -> torch.Tensor:
        weight = self.reader.read(key)
        if weight.dtype != torch.float8_e4m3fn:
            return weight
        scale_key = self._fp8_scale(key, list(weight.shape))[0]
        if scale_key.endswith("_scale_inv"):
            return dequantize_fp8_blocks(weight, self.reader.read(scale_key))
        return weight.float() * self.reader.read(scale_key).float().reshape(-1, 1)
