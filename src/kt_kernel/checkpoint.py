"""Expert weights from safetensors checkpoints.

DeepSeek-V4-Flash layout (MXFP4 experts), optionally under a ``model.`` prefix:
``layers.{L}.ffn.experts.{e}.{w1,w3,w2}.{weight,scale}`` with w1 = gate, w3 = up, w2 = down;
weight I8 ``[N, K/2]`` (two E2M1 codes per byte), scale F8_E8M0 or U8 ``[N, K/32]``.
Files are found through ``*.index.json`` when there is one, else by reading every
``*.safetensors`` header. Only the requested layer is read, tensor by tensor.

Converted layout (written by ``kt-kernel convert``, see kt_kernel.convert): a directory with
``kt_manifest.json`` and one ``layer_{L:03d}.safetensors`` per layer holding
``blk.{L}.ffn_{gate,up,down}_exps.{weight,scale}`` in the format's canonical layout.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import quant

V4_FLASH_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}
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


def index_checkpoint(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of a checkpoint directory (or single file) to the file holding it."""
    path = Path(path)
    if path.is_file():
        return {key: path for key in _keys(path)}
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    indexes = sorted(path.glob("*.safetensors.index.json")) or sorted(path.glob("*.index.json"))
    if indexes:
        files: dict[str, Path] = {}
        for index in indexes:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as error:
                raise CheckpointError(f"{index}: not a safetensors index ({error})") from error
            files.update({key: path / name for key, name in weight_map.items()})
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no .safetensors files in {path}")
    return {key: shard for shard in shards for key in _keys(shard)}


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from error


class TensorReader:
    """Reads tensors by name from an indexed checkpoint, keeping each file open once."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self.files, self._stack, self._open = files, stack, {}

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The tensor ``key``, or only its ``index``-th entry along the first dimension."""
        return self._access(key, lambda f: f.get_tensor(key) if index is None else f.get_slice(key)[index])

    def header(self, key: str) -> tuple[str, list[int]]:
        """The tensor's safetensors dtype ("BF16", "F8_E4M3", ...) and shape; no data is read."""
        return self._access(key, lambda f: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()))

    def _access(self, key: str, action):
        if key not in self.files:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        file = self.files[key]
        try:
            if file not in self._open:
                self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            return action(self._open[file])
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: cannot read tensor {key!r} ({error})") from error


def read_v4_flash_experts(path: str | Path, layer: int, num_experts: int) -> dict[str, torch.Tensor]:
    """MXFP4 experts of one layer as canonical uint8 tensors: gate/up/down [E, N, K/2] and
    gate_scale/up_scale/down_scale [E, N, K/32] (the keyword names of load_weights_from_tensors)."""
    files = index_checkpoint(path)
    prefix = "model." if f"model.layers.{layer}.ffn.experts.0.w1.weight" in files else ""
    result: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = TensorReader(files, stack)
        for name, short in V4_FLASH_PROJECTIONS.items():
            for kind, out_name in (("weight", name), ("scale", f"{name}_scale")):
                stacked = None
                for expert in range(num_experts):
                    key = f"{prefix}layers.{layer}.ffn.experts.{expert}.{short}.{kind}"
                    tensor = reader.read(key)
                    if tensor.dtype not in (torch.int8, torch.uint8, torch.float8_e8m0fnu):
                        raise CheckpointError(
                            f"tensor {key!r} has dtype {tensor.dtype}, expected I8/U8/F8_E8M0"
                        )
                    if stacked is None:
                        stacked = torch.empty((num_experts, *tensor.shape), dtype=torch.uint8)
                    elif tuple(tensor.shape) != tuple(stacked.shape[1:]):
                        raise CheckpointError(
                            f"tensor {key!r} has shape {list(tensor.shape)}, "
                            f"but expert 0 has {list(stacked.shape[1:])}"
                        )
                    stacked[expert] = tensor.view(torch.uint8)
                result[out_name] = stacked
    return result


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a converted checkpoint directory, or None where the directory has none."""
    file = Path(path) / MANIFEST_NAME
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: not a readable manifest ({error})") from error
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), dict):
        raise CheckpointError(f"{file}: not a kt-kernel manifest (no 'layers' table)")
    return manifest


def read_converted_layer(
    path: str | Path, layer: int, num_experts: int, method: str
) -> dict[str, torch.Tensor]:
    """Experts 0..num_experts-1 of one layer of a converted checkpoint (``kt-kernel convert``).

    Returns gate/up/down and, except for BF16, gate_scale/up_scale/down_scale: the arguments of
    KTMoEWrapper.load_weights_from_tensors. ValueError when ``method`` means another format than
    the checkpoint holds; CheckpointError for a missing layer, too few experts or a bad file.
    """
    fmt = quant.weight_format(method)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path} holds no {MANIFEST_NAME}: not a converted checkpoint")
    held = manifest.get("format")
    if held != fmt:
        raise ValueError(
            f"{path} holds {held} weights, but method {method!r} needs {fmt}; "
            f"convert again with --format {fmt.lower()} or pass method={held!r}"
        )
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        done = ", ".join(sorted(manifest["layers"], key=int)) or "none"
        raise CheckpointError(f"layer {layer} is not in the converted checkpoint {path} (layers: {done})")
    if num_experts > entry["experts"]:
        raise CheckpointError(f"layer {layer} of {path} has {entry['experts']} experts, {num_experts} asked")
    file = Path(path) / entry["file"]
    kinds = {"weight": ""} if fmt == "BF16" else {"weight": "", "scale": "_scale"}
    result: dict[str, torch.Tensor] = {}
    try:
        with safe_open(file, framework="pt") as f:
            written = (f.metadata() or {}).get("format")
            if written != fmt:
                raise CheckpointError(f"{file}: holds {written} weights, not {fmt}")
            for projection in PROJECTIONS:
                for kind, suffix in kinds.items():
                    tensor = f.get_slice(converted_tensor_name(layer, projection, kind))
                    result[projection + suffix] = tensor[:num_experts]
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: cannot read layer {layer} ({error})") from error
    return result
