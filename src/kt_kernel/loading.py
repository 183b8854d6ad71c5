"""A layer's weights in its engines: loading them from tensors or a checkpoint (in parts), and the
experts ``gpu_experts_mask`` hands back to the CPU with ``skip_gpu_expert_cpu_copy``."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import torch

from . import checkpoint
from .expert_cache import ExpertCache
from .expert_weights import check_slot_map, prepare, prepare_biases, subpool_slice
from .formats import WeightFormat, nvfp4_as_gguf

#: load_weights reads and packs a layer in this many parts (a part: 1/16 of the experts or one), so
#: that it needs about one part's tensors of memory beyond the packed layer.
LOAD_PARTS = 16

_SCALES = ("gate_scale", "up_scale", "down_scale")
_ZEROS = ("gate_zeros", "up_zeros", "down_zeros")
_BIASES = ("gate_bias", "up_bias", "down_bias")


class LayerWeights:
    """What a layer's engines hold and how it was loaded (the wrapper serializes every call)."""

    def __init__(self, fmt: WeightFormat, subpools: list[Any], num_experts: int, hidden: int, inter: int,
                 layer_idx: int, skip_gpu_copy: bool, cache: ExpertCache | None = None,
                 nvfp4: bool = False) -> None:  # fmt: skip
        self.format, self.subpools = fmt, subpools
        self.cache = cache  # mmap_experts_dir (kt_kernel.expert_cache), or None
        # Method NVFP4 held as GGUF: its tensors (nvfp4_to_fp8's, or read so) converted on load.
        self.nvfp4 = nvfp4
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.layer_idx, self.skip_gpu_copy = layer_idx, skip_gpu_copy
        self.loaded = False
        # Per projection, the inputs one scale covers (1 without group scales), set at load.
        self.scale_groups: dict[str, int] = {}
        self.zero_points = False  # INT4 loaded with zero points (asymmetric GPTQ)
        # Expert biases loaded, per slot (kt_kernel.expert_weights.prepare_biases), or None.
        self.bias_table: dict[str, torch.Tensor] | None = None
        # skip_gpu_expert_cpu_copy: the slots left out of CPU memory (GPU experts at load), and where
        # load_weights read each slot's expert from (None: the weights came from tensors).
        self.unpacked: torch.Tensor | None = None
        self.source_of_slot: torch.Tensor | None = None

    def start(self, gpu_mask: torch.Tensor) -> None:
        """Every slot of every engine unpacked: the parts of a load follow (load_part)."""
        self.loaded = False
        self.zero_points = False
        self.bias_table = None
        self.source_of_slot = None
        self.unpacked = gpu_mask.clone() if self.skip_gpu_copy else None
        for sp in self.subpools:
            sp.engine.unload()
            sp.engine.set_biases(None, None, None)

    def load_tensors(self, gpu_mask: torch.Tensor, tensors: dict[str, torch.Tensor | None],
                     slot_map: torch.Tensor | None) -> None:  # fmt: skip
        """The whole layer from tensors (load_weights_from_tensors), checked before the loaded one is
        dropped."""
        self.load_part(tensors, slot_map, gpu_mask=gpu_mask)
        self.loaded = True

    def load_part(self, tensors: dict[str, torch.Tensor | None], slot_map: torch.Tensor | None,
                  first_expert: int = 0, gpu_mask: torch.Tensor | None = None) -> None:  # fmt: skip
        """Packs the slots slot_map names from ``tensors`` (gate, up, down and optional scales, zeros
        and biases by their keyword names). With ``gpu_mask`` the whole layer, after the checks; else
        one part after start() (-1: a slot of another part), whose tensors hold the experts from
        ``first_expert`` on."""
        part = gpu_mask is None
        if self.nvfp4 and all(tensors.get(name) is not None for name in _SCALES):
            tensors = dict(tensors)
            for name in ("gate", "up", "down"):
                tensors[name], tensors[name + "_scale"] = nvfp4_as_gguf(
                    name + "_proj", tensors[name], name + "_scale", tensors[name + "_scale"], first_expert
                )
        gate, up, down = tensors["gate"], tensors["up"], tensors["down"]
        canonical, slot_map = prepare(
            self.format,
            {"gate_proj": gate, "up_proj": up, "down_proj": down},
            {name: tensors.get(name) for name in _SCALES},
            slot_map,
            self.num_experts,
            self.hidden,
            self.inter,
            {name: tensors.get(name) for name in _ZEROS},
            part,
            first_expert,
        )
        biases = prepare_biases(
            {name: tensors.get(name) for name in _BIASES}, slot_map, gate.shape[0], self.hidden, self.inter
        )
        if not part:
            self.start(gpu_mask)
        if self.unpacked is not None:  # GPU experts stay out of CPU memory
            slot_map = torch.where(self.unpacked, -1, slot_map)
        # Quantized (or checked) for the whole I first, then sliced: any threadpool_count runs the
        # same weights. One subpool at a time, so only one slice's copy exists besides the whole.
        self.scale_groups = {name: self.format.scale_group(v, s) for name, (v, s, _) in canonical.items()}
        self.zero_points |= any(zeros is not None for _, _, zeros in canonical.values())
        for sp in self.subpools:
            sliced, zeros = subpool_slice(self.format, canonical, sp.start, sp.stop, self.inter)
            sp.engine.load(*sliced, slot_map, **zeros)
        if any(b is not None for b in biases.values()):
            self._add_biases(biases, part)

    def _add_biases(self, biases: dict[str, torch.Tensor | None], part: bool) -> None:
        # Each part's slots hold their experts' biases, the others zeros: a load in parts (and an
        # expert the mask hands back later) adds its slots to the table.
        table = self.bias_table if part and self.bias_table is not None else {}
        for name, bias in biases.items():
            if bias is not None:
                table[name] = bias if name not in table else table[name] + bias
        self.bias_table = table
        gate, up, down = (table.get(name) for name in _BIASES)
        for index, sp in enumerate(self.subpools):  # gate/up biases sliced; down's added once
            sliced = [None if b is None else b[:, sp.start : sp.stop].contiguous() for b in (gate, up)]
            sp.engine.set_biases(*sliced, down if index == 0 else None)

    def checkpoint_slot_map(self, weight_path: str | None, physical_to_logical_map_cpu: torch.Tensor | None
                            ) -> torch.Tensor:  # fmt: skip
        """load_weights' slot map, checked before anything is dropped."""
        if weight_path is None:
            raise ValueError("load_weights needs weight_path (a checkpoint directory or GGUF model)")
        if not os.path.exists(weight_path):
            raise FileNotFoundError(errno.ENOENT, "weight_path does not exist", str(weight_path))
        sources = self.num_experts
        if physical_to_logical_map_cpu is not None:
            sources = int(torch.as_tensor(physical_to_logical_map_cpu).max()) + 1
        return check_slot_map(physical_to_logical_map_cpu, sources, self.num_experts)

    def load_checkpoint(self, weight_path: str, slot_map: torch.Tensor, gpu_mask: torch.Tensor,
                        weight_format: str, method: str) -> None:  # fmt: skip
        """The layer from weight_path (read_checkpoint), or mapped from the mmap_experts_dir cache
        where it holds the layer's packed files (kt_kernel.expert_cache)."""
        if self.cache is None:
            self.read_checkpoint(weight_path, slot_map, gpu_mask, weight_format)
            return
        self.cache.load(
            self, weight_path, slot_map, gpu_mask, method,
            lambda: self.read_checkpoint(weight_path, slot_map, gpu_mask, weight_format),
        )  # fmt: skip

    def adopt_mapped(self, meta: dict[str, Any], slot_map: torch.Tensor) -> None:
        """What a load would have set, for engines that mapped the layer's packed files (their
        ``meta``): the scale groups, zero points, the biases' table read back from the engines."""
        self.scale_groups = {name: int(group) for name, group in meta["scale_groups"].items()}
        self.zero_points = bool(meta["zero_points"])
        table: dict[str, torch.Tensor] = {}
        for name, projection in zip(_BIASES, ("gate", "up", "down"), strict=True):
            parts = []
            for sp in self.subpools if projection != "down" else self.subpools[:1]:
                rows = self.hidden if projection == "down" else sp.stop - sp.start
                out = torch.empty(self.num_experts, rows, dtype=torch.float32)
                if sp.engine.biases(projection, out):
                    parts.append(out)
            if parts:
                table[name] = torch.cat(parts, dim=1)
        self.bias_table = table or None
        self.source_of_slot = slot_map
        self.loaded = True

    def read_checkpoint(self, weight_path: str, slot_map: torch.Tensor, gpu_mask: torch.Tensor,
                        weight_format: str) -> None:  # fmt: skip
        """Experts of the layer from weight_path, LOAD_PARTS parts at a time: only a part's tensors
        exist besides the engines' packed copy. Where a part fails, the layer is left unloaded."""
        self.start(gpu_mask)
        # The layer's worker threads read and decode its parts too: a load scales with them.
        threads = sum(sp.threads for sp in self.subpools)
        # Each part is packed before the next is read: the parts can share their memory.
        reader = checkpoint.LayerReader(
            weight_path, self.layer_idx, weight_format, (self.hidden, self.inter), threads, reuse_memory=True
        )
        sources = int(slot_map.max()) + 1  # the experts of the layer the slots name
        per_part = max(1, sources // LOAD_PARTS)
        for first in range(0, sources, per_part):
            experts = range(first, min(sources, first + per_part))
            in_part = (slot_map >= experts.start) & (slot_map < experts.stop)
            if self.unpacked is not None:
                in_part &= ~self.unpacked
            if not in_part.any():
                continue
            self.load_part(
                reader.read(experts), torch.where(in_part, slot_map - experts.start, -1), experts.start
            )
        self.source_of_slot = slot_map
        self.loaded = True

    def load_handed_back(
        self, weight_path: str | None, gpu_mask: torch.Tensor, weight_format: str, before: Callable[[], None]
    ) -> None:
        """skip_gpu_expert_cpu_copy: pack the experts ``gpu_mask`` now gives the CPU that were left out
        of CPU memory, read from weight_path (a RuntimeError where the weights came from tensors);
        ``before()`` runs first, where there are any."""
        need = self.unpacked & ~gpu_mask
        if not bool(need.any()):
            return
        slots = torch.nonzero(need).flatten().tolist()
        if self.source_of_slot is None:
            raise RuntimeError(
                f"experts {slots} are not in CPU memory (skip_gpu_expert_cpu_copy) and the weights came from "
                "tensors: load them again, or mark these experts GPU-resident again"
            )
        before()
        reader = checkpoint.LayerReader(weight_path, self.layer_idx, weight_format)
        for slot in slots:
            source = int(self.source_of_slot[slot])
            tensors = reader.read(range(source, source + 1))
            self.unpacked[slot] = False  # load_part packs only slots not marked unpacked
            try:
                self.load_part(tensors, torch.where(torch.arange(self.num_experts) == slot, 0, -1), source)
            except BaseException:
                self.unpacked[slot] = True
                raise
