"""Safetensors files read safely, whatever they hold: one job, reading the tensors of a checkpoint
directory that may be hostile without hanging or reading outside it.

Files are found through ``*.index.json`` when there is one, else by reading every ``*.safetensors``
header (index_checkpoint). Every file's header is validated (read_safetensors_header) before
safetensors opens it, and anything but a regular file is refused unopened: a bad file is a
CheckpointError naming it, never a hang. TensorReader reads tensors by name. Nothing here knows a
weight format or how a model names its tensors.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open


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


def read_json(file: Path) -> object:
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


def is_non_negative_int(value: object) -> bool:
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
            or not all(is_non_negative_int(dim) for dim in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_non_negative_int(offset) for offset in offsets)
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
    content = read_json(index)
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
    is checked by read_safetensors_header before safetensors opens it. Threads may read at once.

    ``headers``: the checked headers of files read before, shared with the caller (a load reads a
    layer in parts, each through its own TensorReader: a header is parsed once per load, not per
    part)."""

    def __init__(
        self, files: dict[str, Path], stack: ExitStack, headers: dict[Path, SafetensorsHeader] | None = None
    ) -> None:
        self.files, self._stack = files, stack
        self._headers: dict[Path, SafetensorsHeader] = {} if headers is None else headers
        self._open: dict[Path, object] = {}
        self._lock = threading.Lock()  # opening a file, checking its header: once, whichever thread asks

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
            with self._lock:
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
                with self._lock:
                    if file not in self._open:
                        self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            return action(self._open[file])
        except Exception as error:  # safetensors and torch raise assorted types for bad data
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({error})") from error
