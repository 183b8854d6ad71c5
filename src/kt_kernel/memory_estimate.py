"""How much memory a model's routed experts take, from its headers only: ``kt-kernel info --memory``.

For a GGUF model (kt_kernel.gguf_file), a directory written by ``kt-kernel convert``
(kt_kernel.checkpoint) or a Hugging Face model directory as it ships (kt_kernel.sources), per type
stored: the bytes of the routed experts in the files and the bytes KTMoEWrapper.load_weights holds
them in (its engines' ``packed_bytes()``; kt_kernel.held_bytes), over every MoE layer. No expert
data is read. The figures are for one subpool (``threadpool_count=1``) holding every expert; expert
biases (held in fp32) are left out.

Where the engine chooses its layout by the data, the held bytes are the most it can choose
(``exact`` False, "at most"): GGUF values that may fall on 16 levels, mins that may all be 0 and
scales that may factor (gguf_blocks.BlockType says which a ggml type pins down), and GPTQ's zero
points, dropped at load where they are all 0. A ggml type has a layout of its own, the one its data
takes as ggml's quantizer writes it (gguf_expected_layout); the bytes of that layout are the
``expected_bytes``, printed beside the bound ("expected ..., at most ..."). Where the held bytes are
exact, or no layout is expected (GPTQ's zero points, a converted GGUF checkpoint's canonical
tensors), ``expected_bytes`` is ``held_bytes``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import formats
from .checkpoint import read_manifest
from .gguf_blocks import BLOCK_TYPES, BlockType
from .gguf_file import FLOAT_FORMAT, FLOAT_TYPES, GGUF_FORMAT, PROJECTIONS, GGUFModel, is_gguf_checkpoint
from .held_bytes import GgufLayout, gguf_most_bytes, nvfp4_bytes, projection_bytes
from .safetensors_io import DTYPE_BITS, CheckpointError, index_checkpoint, read_safetensors_header
from .sources import ExpertSource, MoELayer, require_source_format, stored_format

GGUF_EXPERTS = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<projection>gate|up|down)_exps\.weight$")


@dataclass
class TypeTotal:
    """The routed experts stored as one type (a ggml type, safetensors dtypes, a converted format),
    held in engine format ``held_as``: over ``projections`` projections of ``layers`` layers. The
    held bytes are exact or the most the engine holds them in (``exact`` False); ``expected_bytes``
    those of the layout the type's data takes (the module docstring)."""

    stored_as: str
    held_as: str
    layers: set[int] = field(default_factory=set)
    projections: int = 0
    file_bytes: int = 0
    held_bytes: int = 0
    exact: bool = True
    expected_bytes: int = 0

    def add(
        self, layer: int, file_bytes: int, held_bytes: int, exact: bool, expected: int | None = None
    ) -> None:
        self.layers.add(layer)
        self.projections += 1
        self.file_bytes += file_bytes
        self.held_bytes += held_bytes
        self.exact = self.exact and exact
        self.expected_bytes += held_bytes if expected is None else expected


@dataclass
class MemoryEstimate:
    path: str
    method: str
    types: dict[str, TypeTotal] = field(default_factory=dict)

    def add(
        self,
        stored_as: str,
        held_as: str,
        layer: int,
        file_bytes: int,
        held: int,
        exact: bool,
        expected: int | None = None,
    ) -> None:
        """One projection: ``expected`` the bytes of its expected layout (None: ``held``)."""
        key = f"{stored_as} -> {held_as}"
        self.types.setdefault(key, TypeTotal(stored_as, held_as)).add(
            layer, file_bytes, held, exact, expected
        )

    @property
    def layers(self) -> int:
        return len(set().union(*(t.layers for t in self.types.values())))

    def as_dict(self) -> dict:
        """The estimate for ``--json``: per type, then the totals."""
        types = [{**asdict(t), "layers": len(t.layers)} for t in self.types.values()]
        return {
            "path": self.path,
            "method": self.method,
            "layers": self.layers,
            "types": types,
            "file_bytes": sum(t.file_bytes for t in self.types.values()),
            "held_bytes": sum(t.held_bytes for t in self.types.values()),
            "exact": all(t.exact for t in self.types.values()),
            "expected_bytes": sum(t.expected_bytes for t in self.types.values()),
        }


def estimate(path: str | Path, method: str | None = None) -> MemoryEstimate:
    """The memory estimate of the model at ``path`` read with ``method`` (default: the format its
    experts are in). ValueError (CheckpointError) for a path that is no model this package reads,
    a model without routed experts, or a method that cannot read it; NotImplementedError where the
    method reads no such directory."""
    fmt = formats.get(method) if method is not None else None
    path = Path(path)
    if is_gguf_checkpoint(path):
        return _gguf_estimate(path, fmt)
    if not path.is_dir():
        raise CheckpointError(f"{path}: neither a .gguf file nor a model directory")
    manifest = read_manifest(path)
    if manifest is not None:
        return _converted_estimate(path, manifest, fmt)
    return _source_estimate(path, fmt, method)


def gguf_bound(block: BlockType, experts: int, rows: int, k: int) -> int:
    """The most bytes the engine holds a GGUF projection of ggml type ``block`` in (never exact):
    values in the type's held bits (BlockType.held_bits: 4-bit indices where its values are 16
    levels, 5- or 6-bit planes where they span 32 or 64, else bytes; the data may take fewer),
    mins where the type has them (they may all be 0), and the larger of the two scale layouts: even
    a type whose scales factor by construction is held with fp32 scales where a block's do not (a
    fp16 scale of Inf or NaN, say)."""
    return gguf_most_bytes(experts, rows, k, block.group, block.held_bits, block.mins)


def gguf_expected_layout(block: BlockType) -> GgufLayout:
    """The layout the engine holds ggml type ``block`` in where its data is as ggml's quantizer writes
    it (BlockType's fields): values in its held bits, its mins, and its scales factored (multiples of
    its ``multiple_bits`` of fp16 factors), or fp16; MXFP4's and NVFP4's (``factored`` None) as
    unsigned E4M3 bytes with an fp32 factor per matrix, no larger than their blocks. The data may
    take another (fewer levels, mins all 0, a scale off fp16's grid: the engine checks at load)."""
    if block.factored is None:
        return GgufLayout(block.held_bits, factored=False, mins=False, e4m3=True)
    return GgufLayout(
        block.held_bits,
        block.factored,
        block.mins,
        half_scales=block.half and not block.factored,
        half_factors=block.half and block.factored,
        multiple_bits=block.multiple_bits,
    )


def gguf_expected(block: BlockType, experts: int, rows: int, k: int) -> int:
    """The bytes the engine holds a GGUF projection of ggml type ``block`` in, in its expected layout
    (gguf_expected_layout): ``block.held_bytes_per_weight()`` per weight (E4M3 layouts: the block's
    bytes per weight) with the engine's rounding (rows padded to whole groups, k to whole 256s for
    the factors), and for E4M3 layouts the fp32 per matrix."""
    return projection_bytes("GGUF", experts, rows, k, block.group, layout=gguf_expected_layout(block))


def _gguf_estimate(path: Path, fmt: formats.WeightFormat | None) -> MemoryEstimate:
    if fmt is not None and fmt.name not in (GGUF_FORMAT, FLOAT_FORMAT):
        raise ValueError(f"{path}: a GGUF model is read with method GGUF or BF16, not {fmt.name}")
    model = GGUFModel(path)
    result = MemoryEstimate(str(path), fmt.name if fmt else GGUF_FORMAT)
    for name, (file, tensor) in model.tensors.items():
        match = GGUF_EXPERTS.match(name)
        if match is None:
            continue
        type_name = tensor.tensor_type.name
        experts, rows, k = (int(d) for d in reversed(tensor.shape.tolist()))
        expected = None
        if type_name in FLOAT_TYPES:
            held, exact, held_as = projection_bytes(FLOAT_FORMAT, experts, rows, k), True, FLOAT_FORMAT
        elif type_name in BLOCK_TYPES and fmt is not formats.BF16:
            held, exact, held_as = gguf_bound(BLOCK_TYPES[type_name], experts, rows, k), False, GGUF_FORMAT
            expected = gguf_expected(BLOCK_TYPES[type_name], experts, rows, k)
        else:
            raise CheckpointError(
                f"{file}: tensor {name!r} is {type_name}, which method {result.method} does not read"
            )
        result.add(type_name, held_as, int(match["layer"]), int(tensor.n_bytes), held, exact, expected)
    if not result.types:
        raise CheckpointError(f"{model.where}: no routed-expert tensors (blk.L.ffn_gate_exps.weight)")
    return result


def _bytes_of(header: tuple[str, list[int]]) -> int:
    dtype, shape = header
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


def _converted_estimate(path: Path, manifest: dict, fmt: formats.WeightFormat | None) -> MemoryEstimate:
    held_as = formats.get(manifest["format"])
    if fmt is not None and fmt is not held_as:
        raise ValueError(f"{path} holds {held_as.name} weights (kt-kernel convert), not {fmt.name}")
    result = MemoryEstimate(str(path), held_as.name)
    for layer, entry in manifest["layers"].items():
        header = read_safetensors_header(path / entry["file"])
        for projection in PROJECTIONS:
            name = f"blk.{layer}.ffn_{projection}_exps."
            weight = header.tensors[name + "weight"]
            scale = header.tensors.get(name + "scale")
            experts, rows, k = (
                weight[1][0],
                weight[1][1],
                entry["intermediate" if projection == "down" else "hidden"],
            )
            per_row = scale[1][-1] if scale else 0
            group = (
                0
                if per_row <= 1 and 0 in held_as.scale_groups
                else held_as.scales_per_group * k // max(per_row, 1)
            )
            if held_as is formats.GGUF:  # the ggml type is gone: int8 values with scales and mins
                held = gguf_most_bytes(experts, rows, k, group, value_bits=8, mins=True)
            else:
                held = projection_bytes(held_as.name, experts, rows, k, group)
            files = _bytes_of(weight) + (_bytes_of(scale) if scale else 0)
            result.add(
                f"converted {held_as.name}",
                held_as.name,
                int(layer),
                files,
                held,
                held_as is not formats.GGUF,
            )
    return result


def _source_estimate(
    path: Path, fmt: formats.WeightFormat | None, method: str | None = None
) -> MemoryEstimate:
    if fmt is not None:
        require_source_format(path, fmt)
    files = index_checkpoint(path)
    if any(".ffn.experts." in key or key.endswith(".mlp.experts.gate_up_proj_blocks") for key in files):
        raise NotImplementedError(f"{path}: the DeepSeek-V4-Flash and gpt-oss layouts are not estimated yet")
    source = ExpertSource(path, files)
    # The file bytes of each expert weight with its companions (scales, zero points; not biases),
    # by the name they share: "...experts.3.gate_proj." (fused experts: the tensor's own name).
    stored: dict[str, int] = {}
    for file in set(files.values()):
        for key, header in read_safetensors_header(file).tensors.items():
            if not key.endswith("bias"):
                base = key if source.naming.fused else key.rpartition(".")[0] + "."
                stored[base] = stored.get(base, 0) + _bytes_of(header)
    result = None
    with source.opened():
        for layer in sorted(source.experts):
            described = source.describe(layer)
            held_as = stored_format(described.dtypes)
            if fmt is not None and fmt is not held_as:
                raise ValueError(f"{path} layer {layer} holds {held_as.name} experts, not {fmt.name}")
            result = result or MemoryEstimate(str(path), held_as.name)
            # NVFP4 under its own method (the default) is held as GGUF (formats.nvfp4_held_as_gguf).
            nvfp4 = (
                formats.nvfp4_held_as_gguf(
                    method or formats.NVFP4_METHOD, described.hidden, described.intermediate
                )
                and "NVFP4" in described.dtypes
            )
            held_name = formats.GGUF.name if nvfp4 else held_as.name
            for file_bytes, held, exact in _source_projections(source, described, held_as, stored, nvfp4):
                result.add("+".join(sorted(described.dtypes)), held_name, layer, file_bytes, held, exact)
    return result


def _source_projections(
    source: ExpertSource,
    layer: MoELayer,
    held_as: formats.WeightFormat,
    stored: dict[str, int],
    nvfp4: bool = False,
) -> Iterator[tuple[int, int, bool]]:
    """Per projection of a Hugging Face layer: (file bytes, held bytes, exact); ``nvfp4``: its NVFP4
    weights held as GGUF."""
    experts, hidden, inter = layer.experts, layer.hidden, layer.intermediate
    for p, (rows, k) in enumerate(((inter, hidden), (inter, hidden), (hidden, inter))):
        key = source.key(p, layer.index, 0)
        if source.naming.fused:  # gate and up share one tensor: half its bytes each
            yield stored[key] // (1 if p == 2 else 2), projection_bytes(held_as.name, experts, rows, k), True
            continue
        bases = (source.key(p, layer.index, e).removesuffix("weight") for e in range(experts))
        group, zero_points = _source_group(source, key, rows, k)
        if nvfp4 and source._checked_header(key)[0] == "NVFP4":
            held = nvfp4_bytes(experts, rows, k)
        else:
            held = projection_bytes(held_as.name, experts, rows, k, group, zero_points)
        yield sum(stored[base] for base in bases), held, not zero_points


def _source_group(source: ExpertSource, key: str, rows: int, k: int) -> tuple[int, bool]:
    """(inputs per scale, zero points) of the weight ``key`` as loaded from its headers, as
    sources.ExpertSource and formats.FP8.stored take it: GPTQ's zero points counted (exact False)."""
    if layout := source._int4_layout(key):
        shape = source.reader.header(source._int4_scale_key(key))[1]
        return k // (shape[1] if layout == "packed" else shape[0]), layout == "gptq"
    dtype, _ = source._checked_header(key)
    if dtype == "NVFP4":
        return formats.NVFP4_BLOCK, False
    if dtype != "F8_E4M3":
        return 0, False
    scale_dtype, shape = source.reader.header(source._fp8_scale(key, [rows, k])[0])
    if scale_dtype in ("U8", "F8_E8M0"):
        return formats.MX_BLOCK, False
    if shape in ([rows], [rows, 1]):
        return 0, False
    if k % formats.FP8_BLOCK == 0 and shape == [-(-rows // formats.FP8_BLOCK), k // formats.FP8_BLOCK]:
        return formats.FP8_BLOCK, False
    return k // shape[-1], False


def _size(count: int) -> str:
    """``1234567`` -> ``"1,234,567 B (1.18 MiB)"``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = min(int(math.log(count, 1024)) if count else 0, len(units) - 1)
    return f"{count:,} B ({count / 1024**power:.2f} {units[power]})"


def _held(count: int, file_bytes: int) -> str:
    """Held bytes with their ratio to the file's: ``"1,234,567 B (1.18 MiB) (1.29x)"``."""
    return f"{_size(count)} ({count / file_bytes if file_bytes else 0.0:.2f}x)"


def format_estimate(result: dict) -> str:
    """MemoryEstimate.as_dict() as text for a person: a line per type stored, then the totals; held
    bytes that are a bound are "at most", after the expected ones where those are fewer."""
    layers = f"{result['layers']} MoE layer{'' if result['layers'] == 1 else 's'}"
    lines = [f"routed experts of {result['path']} (method {result['method']}, {layers}):"]
    for entry in (*result["types"], {**result, "stored_as": "total", "held_as": ""}):
        told = _held(entry["held_bytes"], entry["file_bytes"])
        if not entry["exact"]:
            told = f"at most {told}"
            if entry["expected_bytes"] < entry["held_bytes"]:
                told = f"expected {_held(entry['expected_bytes'], entry['file_bytes'])}, {told}"
        lines.append(
            f"  {entry['stored_as']:<16} {entry['held_as']:<6} file {_size(entry['file_bytes'])}, held {told}"
        )
    lines.append("held: what load_weights keeps in memory (one subpool, every expert; biases aside)")
    return "\n".join(lines)
