"""GGUF checkpoints read: one job, the routed experts of one layer of a ``.gguf`` file or split set
as the canonical tensors of the engine's GGUF format (or of BF16, for float experts).

A model is one ``.gguf`` file or a split set ``{name}-00001-of-0000N.gguf`` (given any of its parts,
or a directory holding one model's files). llama.cpp stores a layer's routed experts as three 3-D
tensors ``blk.{L}.ffn_{gate,up,down}_exps.weight``, all experts in one; gguf.GGUFReader (the
``gguf`` package, imported only here and only when a GGUF file is read) parses the files and
memory-maps the data. ggml writes a shape innermost first, so ``[K, N, E]`` is the array ``[E, N, K]``.

Quantized experts become, per kt_kernel.gguf_blocks, int8 values ``[E, N, K]`` and float32
(scale, min) pairs ``[E, N, 2 * K / G]``; each projection has its own ggml type and so its own G.
Float experts (BF16, F16, F32) are read as BF16, with method GGUF as with BF16 (a warning where
F16/F32 round). A file is checked as ggml's loader checks it (each tensor's data where the one
before it ends, a tensor name once in a split set) and again before each read (a file rewritten
since it was mapped is not read: its pages could be gone). Anything this module cannot read as
asked is a CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_blocks import BLOCK_TYPES, convert_rows
from .safetensors_io import CheckpointError

#: The engine formats a GGUF layer can be read as: its quantized experts, or its float ones.
GGUF_FORMAT = "GGUF"
FLOAT_FORMAT = "BF16"
#: ggml's float types and the numpy dtype GGUFReader gives them in (BF16: raw bytes).
FLOAT_TYPES = {"BF16": np.uint8, "F16": np.float16, "F32": np.float32}
PROJECTIONS = ("gate", "up", "down")
#: llama.cpp's names for a split set's parts (gguf.SHARD_NAME_FORMAT).
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _gguf() -> Any:
    """The gguf package, imported when first needed: it is an optional dependency."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError("reading GGUF files needs the gguf package: pip install kt-kernel[gguf]") from error
    return gguf


def expert_tensor_name(layer: int, projection: str, kind: str = "weight") -> str:
    """``blk.{L}.ffn_{gate,up,down}_exps.{weight,scale}``: the stacked experts of one projection of a
    layer (GGUF's name, which converted checkpoints use too)."""
    return f"blk.{layer}.ffn_{projection}_exps.{kind}"


def is_gguf_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a .gguf file, or a directory holding .gguf files and no safetensors."""
    path = Path(path)
    if path.is_dir():
        names = [entry.name for entry in path.iterdir()]
        return any(n.endswith(".gguf") for n in names) and not any(n.endswith(".safetensors") for n in names)
    return path.suffix == ".gguf"


def gguf_files(path: str | Path) -> tuple[Path, ...]:
    """The files of the model at ``path``: the file itself, or every part of its split set, in
    order. A directory must hold one model. CheckpointError for a missing part."""
    path = Path(path)
    if path.is_dir():
        models: dict[tuple[str, str], list[Path]] = {}
        for file in sorted(path.glob("*.gguf")):
            split = SPLIT_NAME.match(file.name)
            models.setdefault((split["stem"], split["count"]) if split else (file.name, ""), []).append(file)
        if len(models) != 1:
            found = ", ".join(files[0].name for files in models.values()) or "none"
            raise CheckpointError(
                f"{path}: a directory read as a GGUF checkpoint must hold one model's .gguf files, "
                f"found {len(models)} models ({found}); pass the model's file (the first part of a split set)"
            )
        path = next(iter(models.values()))[0]
    split = SPLIT_NAME.match(path.name)
    if split is None:
        return (path,)
    count, number = int(split["count"]), int(split["number"])
    if not 1 <= number <= count:
        raise CheckpointError(
            f"{path}: part {number} of {count} is no part of a split set (numbered 1 to its count)"
        )
    parts = tuple(path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [part.name for part in parts if not part.exists()]
    if missing:
        raise CheckpointError(f"{path}: the split set of {count} parts lacks {', '.join(missing)}")
    return parts


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_dev, status.st_size, status.st_ino, status.st_mtime_ns


def _check_data_ranges(file: Path, reader: Any) -> None:
    """ggml's rule: each tensor's data starts where the one before it ends, padded to the file's
    alignment (gguf.cpp). Two tensors on one range, or swapped, would load as each other's data."""
    expected = 0
    for tensor in reader.tensors:
        offset = tensor.data_offset - reader.data_offset
        if offset != expected:
            raise CheckpointError(
                f"{file}: tensor {tensor.name!r} has its data at offset {offset}, expected {expected} (where "
                "the tensor before it ends, padded): a corrupt tensor table"
            )
        expected += -(-int(tensor.n_bytes) // reader.alignment) * reader.alignment


@functools.lru_cache(maxsize=16)
def _cached_reader(file: str, identity: tuple[int, int, int, int]) -> Any:
    """One GGUFReader per file version (``identity``, kept on the reader): parsing a header (a
    tokenizer's ~150k strings) takes a while, and LayerReader opens the model once per layer."""
    reader = _gguf().GGUFReader(file, "r")
    reader.kt_identity = identity
    return reader


def open_gguf(file: Path) -> Any:
    """gguf.GGUFReader of ``file``; CheckpointError naming it for anything but a regular, well
    formed, little-endian GGUF file (GGUFReader raises assorted errors for truncated or corrupt
    files)."""
    try:
        status = os.stat(file)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: cannot open ({error})") from error
    if not stat.S_ISREG(status.st_mode):  # a FIFO would block np.memmap
        raise CheckpointError(f"{file}: not a regular file")
    _gguf()  # an ImportError, not a corrupt file, when the package is missing
    try:
        reader = _cached_reader(str(file), _identity(status))
    except Exception as error:
        raise CheckpointError(f"{file}: not a valid GGUF file ({type(error).__name__}: {error})") from error
    if reader.byte_order != "I":
        raise CheckpointError(f"{file}: a big-endian GGUF file; only little-endian files are read")
    return reader


def _scalar_field(reader: Any, key: str) -> Any:
    """A metadata value (int or str), or None where the key is absent or holds an array."""
    field = reader.get_field(key)
    if field is None or len(field.types) != 1:
        return None
    value = field.contents()
    return value if isinstance(value, (int, str)) else None


@dataclass(frozen=True)
class GGUFModelInfo:
    """What a GGUF file's metadata says of the model (None where it says nothing)."""

    architecture: str | None
    expert_count: int | None
    expert_used_count: int | None
    embedding_length: int | None
    expert_feed_forward_length: int | None

    @classmethod
    def of(cls, reader: Any) -> GGUFModelInfo:
        arch = _scalar_field(reader, "general.architecture")
        arch = arch if isinstance(arch, str) else None

        def size(key: str) -> int | None:
            value = _scalar_field(reader, f"{arch}.{key}") if arch else None
            return value if isinstance(value, int) else None

        return cls(
            arch,
            size("expert_count"),
            size("expert_used_count"),
            size("embedding_length"),
            size("expert_feed_forward_length"),
        )


class GGUFModel:
    """A GGUF model's files opened: its metadata (``info``) and its tensors by name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = gguf_files(path)
        readers = [open_gguf(file) for file in self.files]
        self.info = GGUFModelInfo.of(readers[0])
        for number, (file, reader) in enumerate(zip(self.files, readers, strict=True)):
            count = _scalar_field(reader, "split.count")
            if count is not None and count != len(self.files):
                raise CheckpointError(
                    f"{file}: part of a split set of {count} files (split.count), {len(self.files)} found"
                )
            if count is not None and _scalar_field(reader, "split.no") != number:
                raise CheckpointError(
                    f"{file}: split.no is {_scalar_field(reader, 'split.no')}, not {number}"
                )
        self.tensors: dict[str, tuple[Path, Any]] = {}
        for file, reader in zip(self.files, readers, strict=True):
            _check_data_ranges(file, reader)
            for tensor in reader.tensors:
                if tensor.name in self.tensors:  # ggml refuses a name twice: which copy is meant?
                    raise CheckpointError(
                        f"{file}: tensor {tensor.name!r} is also in {self.tensors[tensor.name][0]}: a name "
                        "may appear once in a split set"
                    )
                self.tensors[tensor.name] = (file, tensor)
        # What each file was when its data was mapped: a file changed since is not read (require_unchanged).
        self._identity = {file: reader.kt_identity for file, reader in zip(self.files, readers, strict=True)}

    def require_unchanged(self, file: Path, tensor: str) -> None:
        """CheckpointError naming the file and tensor where ``file`` is no longer the file mapped
        (rewritten or truncated in place): reading a mapped page past its new end is a SIGBUS,
        which no ``except`` catches."""
        try:
            now = _identity(os.stat(file))
        except OSError as error:
            raise CheckpointError(f"{file}: tensor {tensor!r} cannot be read ({error})") from error
        if now != self._identity[file]:
            raise CheckpointError(
                f"{file}: changed since it was opened (size {self._identity[file][1]} -> {now[1]} bytes): "
                f"tensor {tensor!r} is not read from a file being rewritten; load again once it is complete"
            )

    @property
    def where(self) -> str:
        """The model in messages: its file, or its split set's first part."""
        return (
            str(self.files[0])
            if len(self.files) == 1
            else f"{self.files[0]} (split set of {len(self.files)})"
        )


@dataclass(frozen=True)
class _ExpertTensor:
    """One projection's experts: the tensor's name, file, ggml type and memory-mapped data
    ``[E, N, row]`` (row: K values, or K's blocks in bytes)."""

    name: str
    file: Path
    type_name: str
    shape: tuple[int, int, int]
    data: np.ndarray

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: tensor {self.name!r} {problem}")


class GGUFLayerReader:
    """The routed experts of one layer of a GGUF model, a range of experts at a time.

    ``format_name``: GGUF_FORMAT (any experts: quantized ones as canonical values and scale/min
    pairs, float ones as bf16; ``held_format`` says which) or FLOAT_FORMAT (float experts only, as
    bf16). ``sizes``: the caller's (hidden, intermediate); the layer's tensors are checked against
    them, the model's metadata and each other here, before any expert is read.
    """

    def __init__(
        self, path: str | Path, layer: int, format_name: str, sizes: tuple[int, int] | None = None
    ) -> None:
        if format_name not in (GGUF_FORMAT, FLOAT_FORMAT):
            raise ValueError(
                f"{path}: a GGUF checkpoint is read with method {GGUF_FORMAT!r} (any experts) or "
                f"{FLOAT_FORMAT!r} (float experts), not {format_name!r}"
            )
        self.model = GGUFModel(path)
        self.layer, self.format_name = layer, format_name
        self.projections = {p: self._find(expert_tensor_name(layer, p)) for p in PROJECTIONS}
        self._refuse_unknown_tensors()
        self.experts, self.intermediate, self.hidden = self._check_shapes(sizes)
        #: The engine format the experts are read as: method GGUF reads float experts as BF16 too.
        self.held_format = self._check_types()
        self.biases = {p: self._bias(p) for p in PROJECTIONS}

    @property
    def info(self) -> GGUFModelInfo:
        return self.model.info

    def _find(self, name: str) -> _ExpertTensor:
        if name not in self.model.tensors:
            prefix = f"blk.{self.layer}.ffn"
            present = sorted(n for n in self.model.tensors if n.startswith(prefix))
            raise CheckpointError(
                f"{self.model.where}: no tensor {name!r} (layer {self.layer}'s ffn tensors: "
                f"{', '.join(present) or 'none'})"
            )
        file, tensor = self.model.tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml's order is innermost first
        return _ExpertTensor(name, file, tensor.tensor_type.name, shape, tensor.data)

    def _refuse_unknown_tensors(self) -> None:
        """A tensor beside an expert weight that is not its bias (NVFP4's per-tensor ``.scale``,
        say) changes what the weight means: refused rather than silently left out."""
        for projection in PROJECTIONS:
            prefix = expert_tensor_name(self.layer, projection, "")
            for name in self.model.tensors:
                if name.startswith(prefix) and name[len(prefix) :] not in ("weight", "bias"):
                    raise CheckpointError(
                        f"{self.model.tensors[name][0]}: tensor {name!r} goes with the experts' weight, "
                        "and kt-kernel does not apply it"
                    )

    def _check_shapes(self, sizes: tuple[int, int] | None) -> tuple[int, int, int]:
        info, gate = self.model.info, self.projections["gate"]
        experts = info.expert_count if info.expert_count is not None else gate.shape[0]
        if sizes is not None:
            hidden, inter = sizes
        else:
            hidden = info.embedding_length if info.embedding_length is not None else gate.shape[2]
            inter = (
                info.expert_feed_forward_length
                if info.expert_feed_forward_length is not None
                else gate.shape[1]
            )
        for projection, tensor in self.projections.items():
            expected = (experts, hidden, inter) if projection == "down" else (experts, inter, hidden)
            if tensor.shape != expected:
                raise tensor.fail(
                    f"has shape [E, N, K] = {list(tensor.shape)}; layer {self.layer} has {experts} experts, "
                    f"hidden size {hidden} and intermediate size {inter}: expected {list(expected)}"
                )
        # The caller's sizes agree with the tensors: the metadata must too (llama.cpp reads it).
        for key, declared, actual in (
            ("embedding_length", info.embedding_length, hidden),
            ("expert_feed_forward_length", info.expert_feed_forward_length, inter),
        ):
            if declared is not None and declared != actual:
                raise gate.fail(
                    f"has shape [E, N, K] = {list(gate.shape)}, but the metadata's {info.architecture}.{key} "
                    f"is {declared}, not {actual}: the file disagrees with itself"
                )
        return experts, inter, hidden

    def _check_types(self) -> str:
        quantized_types, float_types = ", ".join(BLOCK_TYPES), ", ".join(FLOAT_TYPES)
        supported = f"{quantized_types} (method {GGUF_FORMAT}), {float_types} (method {FLOAT_FORMAT})"
        for tensor in self.projections.values():
            if tensor.type_name not in BLOCK_TYPES and tensor.type_name not in FLOAT_TYPES:
                raise tensor.fail(
                    f"is {tensor.type_name}, which kt-kernel cannot read; supported: {supported}"
                )
        floats = [t for t in self.projections.values() if t.type_name in FLOAT_TYPES]
        quantized = [t for t in self.projections.values() if t.type_name in BLOCK_TYPES]
        if floats and quantized:
            raise floats[0].fail(
                f"is {floats[0].type_name} while {quantized[0].name!r} is {quantized[0].type_name}: a layer "
                "mixing float and quantized projections fits no single engine format"
            )
        if self.format_name == FLOAT_FORMAT and quantized:
            raise quantized[0].fail(
                f"is {quantized[0].type_name}, a quantized type: read it with method={GGUF_FORMAT!r}"
            )
        if quantized:
            return GGUF_FORMAT
        rounded = [f"{t.name!r} ({t.type_name})" for t in floats if t.type_name != "BF16"]
        if rounded:
            warnings.warn(
                f"{floats[0].file}: method {self.format_name} holds float experts as bf16: it rounds "
                f"{', '.join(rounded)}",
                stacklevel=3,
            )
        return FLOAT_FORMAT

    def _bias(self, projection: str) -> np.ndarray | None:
        """gpt-oss's expert biases ``[E, N]``, where the layer has them."""
        name = expert_tensor_name(self.layer, projection, "bias")
        if name not in self.model.tensors:
            return None
        file, tensor = self.model.tensors[name]
        rows = self.projections[projection].shape[1]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if tensor.tensor_type.name not in FLOAT_TYPES or shape != (self.experts, rows):
            raise CheckpointError(
                f"{file}: tensor {name!r} is {tensor.tensor_type.name} {list(shape)}, expected a float "
                f"tensor {[self.experts, rows]}"
            )
        return tensor.data

    def read(self, experts: int | range, threads: int | None = None) -> dict[str, torch.Tensor]:
        """Experts 0..experts-1, or the range ``experts``, as the keyword arguments of
        load_weights_from_tensors: gate/up/down and (GGUF) gate_scale/up_scale/down_scale, and
        gate_bias/up_bias/down_bias (float32) where the layer has biases. Only those experts' bytes
        are read, their blocks decoded on ``threads`` threads (None: torch's)."""
        experts = range(experts) if isinstance(experts, int) else experts
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= self.experts:
            raise CheckpointError(
                f"{self.model.where}: layer {self.layer} has {self.experts} experts, {experts} asked"
            )
        rows = slice(experts.start, experts.stop)
        result: dict[str, torch.Tensor] = {}
        for projection, tensor in self.projections.items():
            self.model.require_unchanged(tensor.file, tensor.name)
            try:
                if self.held_format == GGUF_FORMAT:
                    values, pairs = convert_rows(tensor.type_name, tensor.data[rows], threads)
                    self._require_finite(tensor, pairs, experts.start)
                    result[f"{projection}_scale"] = torch.from_numpy(pairs)
                    result[projection] = torch.from_numpy(values)
                else:
                    result[projection] = _as_bf16(tensor.type_name, tensor.data[rows])
            except OSError as error:  # the mapped file changed under us
                raise tensor.fail(f"cannot be read ({error})") from error
        for projection, bias in self.biases.items():
            if bias is not None:
                name = expert_tensor_name(self.layer, projection, "bias")
                self.model.require_unchanged(self.model.tensors[name][0], name)
                result[f"{projection}_bias"] = torch.from_numpy(np.array(bias[rows], dtype=np.float32))
        return result

    @staticmethod
    def _require_finite(tensor: _ExpertTensor, pairs: np.ndarray, first_expert: int) -> None:
        bad = ~np.isfinite(pairs)
        if bad.any():
            expert, row, column = (int(i) for i in np.argwhere(bad)[0])
            kind = ("scale", "min")[column % 2]
            raise tensor.fail(
                f"holds a non-finite {kind} (expert {first_expert + expert}, row {row}, "
                f"group {column // 2}): a corrupt block"
            )


def gguf_layer_format(path: str | Path, layer: int) -> str:
    """The engine format method GGUF holds layer ``layer`` of the GGUF model at ``path`` in: BF16
    where its experts are float, else GGUF. CheckpointError where the model cannot be opened."""
    entry = GGUFModel(path).tensors.get(expert_tensor_name(layer, "gate"))
    return FLOAT_FORMAT if entry is not None and entry[1].tensor_type.name in FLOAT_TYPES else GGUF_FORMAT


def _as_bf16(type_name: str, data: np.ndarray) -> torch.Tensor:
    """Float expert data (BF16 as raw bytes, F16, F32) as a bf16 tensor of its own memory."""
    if type_name == "BF16":
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(data, dtype=FLOAT_TYPES[type_name])).to(torch.bfloat16)
