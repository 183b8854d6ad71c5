"""This package's own checkpoints and the layer readers: one job, the experts of one layer from
a checkpoint directory, as the keyword arguments of KTMoEWrapper.load_weights_from_tensors.

Converted layout (written by ``kt-kernel convert``, see kt_kernel.convert): a directory with
``kt_manifest.json`` and one ``layer_{L:03d}.safetensors`` per layer holding
``blk.{L}.ffn_{gate,up,down}_exps.{weight,scale}`` in the format's canonical layout.

DeepSeek-V4-Flash layout (MXFP4 experts, loaded without conversion), optionally under a ``model.``
prefix: ``layers.{L}.ffn.experts.{e}.{w1,w3,w2}.{weight,scale}`` with w1 = gate, w3 = up, w2 = down;
weight I8 ``[N, K/2]`` (two E2M1 codes per byte), scale F8_E8M0 or U8 ``[N, K/32]``. Only the
requested layer is read, tensor by tensor.

gpt-oss layout (MXFP4 experts with biases, loaded without conversion), optionally under a
``model.`` prefix: ``layers.{L}.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}``, all experts in
one tensor; blocks U8 ``[E, N, K/32, 16]`` (two E2M1 codes per byte, the low nibble first), scales
U8 ``[E, N, K/32]`` (E8M0), bias ``[E, N]`` (float); gate and up interleaved along N (gate the even
rows, up the odd ones), as gpt-oss's ``gate_up[..., ::2]`` and ``[..., 1::2]``.

read_layer and LayerReader take any of these, a Hugging Face model directory as it ships
(kt_kernel.sources), or a GGUF model: a ``.gguf`` file, a split set, or a directory of .gguf files
(kt_kernel.gguf_file; method GGUF for any of its experts, float ones as BF16; BF16 for float
ones). Safetensors files are read through kt_kernel.safetensors_io.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from . import formats, load_threads
from .gguf_file import GGUF_FORMAT, GGUFLayerReader, expert_tensor_name, gguf_layer_format, is_gguf_checkpoint
from .safetensors_io import (
    CheckpointError,
    TensorReader,
    index_checkpoint,
    is_non_negative_int,
    read_json,
    read_safetensors_header,
)
from .sources import (
    PROJECTIONS,
    Experts,
    expert_range,
    read_source_experts,
    require_source_format,
    source_layer,
)

V4_FLASH_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}
#: The format DeepSeek-V4-Flash ships its routed experts in: loaded without conversion.
V4_FLASH_FORMAT = "MXFP4"
MANIFEST_NAME = "kt_manifest.json"


def converted_file_name(layer: int) -> str:
    """The file of one layer in a converted checkpoint."""
    return f"layer_{layer:03d}.safetensors"


def read_v4_flash_experts(
    path: str | Path,
    layer: int,
    experts: Experts,
    files: dict[str, Path] | None = None,
    threads: int | None = None,
    headers: dict | None = None,
    buffers: load_threads.PartBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """MXFP4 experts of one layer as canonical uint8 tensors: gate/up/down [E, N, K/2] and
    gate_scale/up_scale/down_scale [E, N, K/32] (the keyword names of load_weights_from_tensors).
    ``files``: the checkpoint's index_checkpoint, where the caller has it already; the experts are
    read on ``threads`` threads (load_threads.each) into ``buffers``' memory where given;
    ``headers``: as TensorReader's."""
    experts = expert_range(experts)
    files = files if files is not None else index_checkpoint(path)
    prefix = "model." if f"model.layers.{layer}.ffn.experts.0.w1.weight" in files else ""
    result: dict[str, torch.Tensor] = {}
    tensors = [
        (kind, out_name, short)
        for name, short in V4_FLASH_PROJECTIONS.items()
        for kind, out_name in (("weight", name), ("scale", f"{name}_scale"))
    ]

    def read(index: int) -> None:
        for kind, out_name, short in tensors:
            key = f"{prefix}layers.{layer}.ffn.experts.{experts[index]}.{short}.{kind}"
            tensor = reader.read(key)
            if tensor.dtype not in (torch.int8, torch.uint8, torch.float8_e8m0fnu):
                raise CheckpointError(f"tensor {key!r} has dtype {tensor.dtype}, expected I8/U8/F8_E8M0")
            if index == 0:
                result[out_name] = load_threads.empty(
                    buffers, out_name, (len(experts), *tensor.shape), torch.uint8
                )
            elif tuple(tensor.shape) != tuple(result[out_name].shape[1:]):
                raise CheckpointError(
                    f"tensor {key!r} has shape {list(tensor.shape)}, "
                    f"but expert {experts.start} has {list(result[out_name].shape[1:])}"
                )
            result[out_name][index] = tensor.view(torch.uint8)

    with ExitStack() as stack:
        reader = TensorReader(files, stack, headers)
        read(0)  # the first expert's shapes size the tensors
        load_threads.each(read, range(1, len(experts)), threads)
    return result


def gpt_oss_prefix(files: dict[str, Path], layer: int) -> str | None:
    """The prefix of layer ``layer``'s experts in the gpt-oss layout ("model." or ""), None if not."""
    for prefix in ("model.", ""):
        if f"{prefix}layers.{layer}.mlp.experts.gate_up_proj_blocks" in files:
            return prefix
    return None


def expect(key: str, tensor: torch.Tensor, ok: bool, expected: str) -> None:
    """CheckpointError naming the tensor, its dtype and shape, and what was expected, unless ok."""
    if not ok:
        raise CheckpointError(
            f"tensor {key!r} has dtype {tensor.dtype} and shape {list(tensor.shape)}, expected {expected}"
        )


def read_gpt_oss_experts(
    files: dict[str, Path], layer: int, experts: Experts, prefix: str
) -> dict[str, torch.Tensor]:
    """gpt-oss's MXFP4 experts of one layer, bit for bit, as canonical uint8 tensors: gate/up/down
    [E, N, K/2], their E8M0 scales [E, N, K/32], and the biases gate_bias/up_bias [E, I], down_bias
    [E, H] (float32): the keyword names of load_weights_from_tensors."""
    experts = expert_range(experts)
    base = f"{prefix}layers.{layer}.mlp.experts"
    rows = slice(experts.start, experts.stop)
    result: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = TensorReader(files, stack)
        for fused, names in (("gate_up", ("gate", "up")), ("down", ("down",))):
            keys = [f"{base}.{fused}_proj_{kind}" for kind in ("blocks", "scales", "bias")]
            blocks, scales, bias = (reader.read(key, rows) for key in keys)
            four_d = blocks.dim() == 4 and blocks.shape[-1] == 16
            expect(keys[0], blocks, blocks.dtype == torch.uint8 and four_d, "U8 [E, N, K/32, 16]")
            expect(keys[1], scales, scales.dtype == torch.uint8 and scales.shape == blocks.shape[:3],
                   f"U8 {list(blocks.shape[:3])}")  # fmt: skip
            expect(keys[2], bias, bias.dtype.is_floating_point and bias.shape == blocks.shape[:2],
                   f"a float tensor {list(blocks.shape[:2])}")  # fmt: skip
            values = blocks.reshape(*blocks.shape[:2], -1)
            for offset, name in enumerate(names):  # gate_up: gate on the even rows, up on the odd ones
                pick = slice(offset, None, len(names))
                result[name] = values[:, pick].contiguous()
                result[f"{name}_scale"] = scales[:, pick].contiguous()
                result[f"{name}_bias"] = bias[:, pick].float().contiguous()
    return result


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a converted checkpoint directory, or None where the directory has none.
    CheckpointError, naming the manifest, for one that is not a regular file or not well formed."""
    file = Path(path) / MANIFEST_NAME
    if not os.path.lexists(file):
        return None
    manifest = read_json(file)
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, dict) or not isinstance(manifest.get("format"), str):
        raise CheckpointError(f"{file}: not a kt-kernel manifest (no 'format' and 'layers' table)")
    for layer, entry in layers.items():
        ok = layer.isdecimal() and isinstance(entry, dict) and isinstance(entry.get("file"), str)
        # The file is a plain name: a manifest cannot send the loader outside its directory.
        if not ok or entry["file"] != Path(entry["file"]).name or entry["file"] in ("", ".", ".."):
            raise CheckpointError(f"{file}: layer {layer!r} has no valid file entry")
        if not all(is_non_negative_int(entry.get(size)) for size in ("experts", "hidden", "intermediate")):
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
    experts = expert_range(experts)
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
        projection + ("" if kind == "weight" else f"_{kind}"): expert_tensor_name(layer, projection, kind)
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


def engine_format(path: str | Path | None, layer: int, method: str) -> str:
    """The format the engine holds layer ``layer`` read from ``path`` with ``method`` in: the
    method's, except that method GGUF (LLAMAFILE) holds a GGUF model's float experts as BF16. A model
    that cannot be opened counts as the method's: load_weights reports it."""
    name = formats.get(method).name
    if name != GGUF_FORMAT or path is None or not is_gguf_checkpoint(path):
        return name
    try:
        return gguf_layer_format(path, layer)
    except (CheckpointError, ImportError):
        return name


def read_layer(path: str | Path, layer: int, experts: Experts, method: str) -> dict[str, torch.Tensor]:
    """Experts 0..experts-1 (or the range ``experts``) of one layer of a checkpoint directory, as the
    keyword arguments of KTMoEWrapper.load_weights_from_tensors: a converted checkpoint in the
    method's format, one in the DeepSeek-V4-Flash or gpt-oss layout (MXFP4), or a Hugging Face model directory
    as it ships (the formats with ``source_dtypes`` in the registry, kt_kernel.formats)."""
    return LayerReader(path, layer, method).read(experts)


class LayerReader:
    """Reads the experts of one layer of a checkpoint directory or GGUF model (as read_layer), a
    range at a time: the directory is indexed, and a Hugging Face directory's or GGUF model's layer
    found and checked, once, not per range (a big model's index holds ~100k tensor names)."""

    def __init__(
        self,
        path: str | Path,
        layer: int,
        method: str,
        sizes: tuple[int, int] | None = None,
        threads: int | None = None,
        reuse_memory: bool = False,
    ) -> None:
        """``sizes``: the (hidden, intermediate) the caller's layer has; a Hugging Face directory's
        or GGUF model's layer of other sizes is refused here, from the headers, before any expert is
        read. ``threads``: how many threads read and decode the experts (None: torch's).
        ``reuse_memory``: a read may return the last read's tensors, overwritten (the caller is done
        with them: load_weights packs each part before it reads the next)."""
        self.path, self.layer, self.method = path, layer, method
        buffers = load_threads.PartBuffers() if reuse_memory else None
        self._read = self._reader_of(path, layer, method, sizes, threads, buffers)  # chosen once

    @staticmethod
    def _reader_of(
        path: str | Path,
        layer: int,
        method: str,
        sizes: tuple[int, int] | None,
        threads: int | None,
        buffers: load_threads.PartBuffers | None,
    ) -> Callable[[Experts], dict[str, torch.Tensor]]:
        fmt = formats.get(method)
        if is_gguf_checkpoint(path):
            gguf = GGUFLayerReader(path, layer, fmt.name, sizes)
            return lambda experts: gguf.read(experts, threads)
        if read_manifest(path) is not None:
            return lambda experts: read_converted_layer(path, layer, experts, method)
        if fmt.name == V4_FLASH_FORMAT:
            files = index_checkpoint(path)
            prefix = gpt_oss_prefix(files, layer)
            if prefix is not None:
                return lambda experts: read_gpt_oss_experts(files, layer, experts, prefix)
            checked: dict = {}  # safetensors headers checked, kept from one range to the next
            return lambda experts: read_v4_flash_experts(
                path, layer, experts, files, threads, checked, buffers
            )
        require_source_format(path, fmt)
        source, described = source_layer(path, layer, fmt, index_checkpoint(path))
        if sizes is not None and (described.hidden, described.intermediate) != tuple(sizes):
            raise CheckpointError(
                f"{path} layer {layer}: experts of hidden size {described.hidden} and intermediate size "
                f"{described.intermediate}, the layer has {sizes[0]} and {sizes[1]}"
            )
        return lambda experts: read_source_experts(source, described, experts, threads, buffers)

    def read(self, experts: Experts) -> dict[str, torch.Tensor]:
        return self._read(experts)
