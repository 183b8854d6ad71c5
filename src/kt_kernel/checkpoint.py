"""Expert weights from safetensors checkpoints.

DeepSeek-V4-Flash layout (MXFP4 experts), optionally under a ``model.`` prefix:
``layers.{L}.ffn.experts.{e}.{w1,w3,w2}.{weight,scale}`` with w1 = gate, w3 = up, w2 = down;
weight I8 ``[N, K/2]`` (two E2M1 codes per byte), scale F8_E8M0 or U8 ``[N, K/32]``.
Files are found through ``*.index.json`` when there is one, else by reading every
``*.safetensors`` header. Only the requested layer is read, tensor by tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

V4_FLASH_PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}


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

    def read(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        file = self.files[key]
        try:
            if file not in self._open:
                self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
            return self._open[file].get_tensor(key)
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
