"""Hugging Face source checkpoints decoded: one job, the routed experts of a model directory as it
ships (what ``kt-kernel convert`` and read_layer read), one expert at a time.

ExpertSource finds the routed experts by one of NAMINGS and checks a layer from the headers
(describe); it reads each expert's weights as stored: float weights as they are, FP8 codes with
their scales (``weight_scale_inv`` per 128 x 128 block or, MXFP8 as MiniMax-M3 ships it, E8M0 per 32
inputs of a row; or ``weight_scale`` per output channel),
INT4 as compressed-tensors packs it (``weight_packed``) or GPTQ does (``qweight``). Which format a
layer is in, and which formats a source directory may be read in, the format registry says
(WeightFormat.source_dtypes). Files are read through kt_kernel.safetensors_io.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import formats, load_threads
from .safetensors_io import CheckpointError, TensorReader, index_checkpoint, read_json

PROJECTIONS = ("gate", "up", "down")
#: Which experts of a layer the readers return: experts 0..n-1, or a range of them.
Experts = int | range


def expert_range(experts: Experts) -> range:
    return range(experts) if isinstance(experts, int) else experts


#: Float weights, read as they are; also the dtypes scales may be stored in.
_FLOAT_DTYPES = ("BF16", "F16", "F32")
#: FP8 weights, each with a scale tensor beside it (ExpertSource._fp8_scale).
_FP8_DTYPE = "F8_E4M3"
#: MXFP8's scales: E8M0 exponents, one per 32 inputs of a row.
_E8M0_DTYPES = ("U8", "F8_E8M0")
_PREFIX = r"^(?P<prefix>(?:[\w-]+\.)*?)layers\.(?P<layer>\d+)\."
# A weight, or the packed INT4 of compressed-tensors (Kimi-K2-Thinking) or of GPTQ.
_WEIGHT_SUFFIX = r"(?:weight|weight_packed|qweight)$"
#: How MoELayer.dtypes, and the registry's source_dtypes, name INT4 sources (their tensors are I32).
_INT4_DTYPE = "I4"
#: How MoELayer.dtypes, and FP8's source_dtypes, name NVFP4 weights (ModelOpt): U8 E2M1 pairs with a
#: ``weight_scale`` F8_E4M3 per 16 inputs and a ``weight_scale_2`` F32 per tensor, read as FP8 exactly.
_NVFP4_DTYPE = "NVFP4"


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


def _mx_shape(shape: list[int]) -> list[int] | None:
    """The E8M0 scales' shape of an FP8 weight [N, K] in MXFP8's blocks of 32, where K allows them."""
    if len(shape) != 2 or shape[1] % formats.MX_BLOCK:
        return None
    return [shape[0], shape[1] // formats.MX_BLOCK]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = formats.FP8_BLOCK):
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


def _require_fp8_scale(key: str, dtype: str, shape: list[int], mx_shape: list[int] | None) -> None:
    """An FP8 weight's scales: float, or E8M0 (U8, F8_E8M0) in MXFP8's blocks of 32 (``mx_shape``)."""
    if dtype in _E8M0_DTYPES:
        if shape != mx_shape:
            raise CheckpointError(
                f"tensor {key!r} holds E8M0 scales ({dtype}), MXFP8's, which take shape {mx_shape}; "
                f"got {shape}"
            )
        return
    _require_float_scale(key, dtype)


class ExpertSource:
    """The routed experts of a checkpoint, found by name and read one expert at a time."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path, self.files = path, files
        self.naming, self.prefix, self.experts = self._detect(files)
        self.reader: TensorReader
        self._headers: dict = {}  # the files' checked headers, kept from one opened() to the next

    @contextmanager
    def opened(self) -> Iterator[ExpertSource]:
        """Read inside this only. Files are memory-mapped while open and the pages read count in
        the process's RSS until they are closed: opening them per layer keeps that to one layer."""
        with ExitStack() as stack:
            self.reader = TensorReader(self.files, stack, self._headers)
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
        dtypes, shapes, stored_as, int4_scales = set(), {}, {}, {}
        for expert in range(self.experts[layer]):
            for projection in range(3):
                key = self.key(projection, layer, expert)
                dtype, shape = self._checked_header(key)
                dtypes.add(dtype)
                expected = shapes.setdefault(projection, shape)
                if shape != expected:
                    raise CheckpointError(f"tensor {key!r} has shape {shape}, expert 0 has {expected}")
                if dtype == _INT4_DTYPE:  # the group size is the scales' shape: one for the layer
                    scale_key = self._int4_scale_key(key)
                    scale = self.reader.header(scale_key)[1]
                    if scale != int4_scales.setdefault(projection, scale):
                        raise CheckpointError(
                            f"{self.files[scale_key]}: tensor {scale_key!r} has shape {scale}, expert 0's "
                            f"{int4_scales[projection]}: the experts of a layer share one group size"
                        )
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
        # NVFP4: U8 with its E4M3 block scales; a missing per-tensor scale is named as such.
        if dtype == "U8" and (key + "_scale_2" in self.reader or key + "_scale" in self.reader):
            return _NVFP4_DTYPE, self._nvfp4_shape(key, shape)
        if dtype == _FP8_DTYPE:
            scale_key, expected = self._fp8_scale(key, shape)
            scale_dtype, scale_shape = self.reader.header(scale_key)
            _require_fp8_scale(scale_key, scale_dtype, scale_shape, _mx_shape(shape))
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

    def _nvfp4_shape(self, key: str, shape: list[int]) -> list[int]:
        """[N, K] of an NVFP4 weight stored [N, K/2], its scales checked (headers only)."""
        if len(shape) != 2:
            raise CheckpointError(f"tensor {key!r} has shape {shape}, expected 2-D (NVFP4: [N, K/2])")
        n, k = shape[0], 2 * shape[1]
        expected = {
            key + "_scale": ("F8_E4M3", [[n, k // formats.NVFP4_BLOCK]]),
            key + "_scale_2": ("F32", [[], [1]]),
        }
        for scale_key, (dtype, shapes) in expected.items():
            if scale_key not in self.reader:
                raise CheckpointError(
                    f"{self.files[key]}: NVFP4 weight {key!r} (U8 E2M1 pairs) lacks its {dtype} scale "
                    f"{scale_key!r}"
                )
            got_dtype, got_shape = self.reader.header(scale_key)
            if got_dtype != dtype or got_shape not in shapes or k % formats.NVFP4_BLOCK:
                raise CheckpointError(
                    f"tensor {scale_key!r} has dtype {got_dtype} and shape {got_shape}; NVFP4's {key!r} "
                    f"{shape} needs {dtype} {' or '.join(map(str, shapes))}"
                )
        return [n, k]

    def _read_nvfp4(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """An NVFP4 weight as FP8 codes [N, K] and float32 scales [N, K/16] (formats.nvfp4_to_fp8)."""
        global_scale = self.reader.read(key + "_scale_2").reshape(())
        if not bool(torch.isfinite(global_scale) & (global_scale > 0)):
            raise CheckpointError(
                f"{self.files[key]}: tensor {key + '_scale_2'!r} holds {global_scale.item()}: scales must "
                "be finite and positive"
            )
        block_scales = self.reader.read(key + "_scale")
        codes = block_scales.view(torch.uint8)
        # E4M3's sign bit (a negative scale, or -0) and its NaN codes 0x7F/0xFF: no scale ModelOpt writes.
        bad = (codes >= 0x80) | (codes == 0x7F)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise CheckpointError(
                f"{self.files[key]}: tensor {key + '_scale'!r} holds the block scale "
                f"{block_scales.view(torch.float8_e4m3fn)[tuple(where)].item()} (code "
                f"0x{int(codes[tuple(where)]):02X}) at index {where}: block scales must be finite and "
                "non-negative"
            )
        return formats.nvfp4_to_fp8(self.reader.read(key), block_scales, global_scale)

    def _fp8_scale(self, key: str, shape: list[int]) -> tuple[str, list[list[int]]]:
        """The scale tensor of an FP8 weight and the shapes it may have: ``weight_scale_inv`` per
        128 x 128 block (DeepSeek) or per 32 inputs of a row (MXFP8), or compressed-tensors'
        ``weight_scale`` per row."""
        if key + "_scale_inv" in self.reader or key + "_scale" not in self.reader:
            blocks = [-(-size // formats.FP8_BLOCK) for size in shape]
            return key + "_scale_inv", [blocks] + ([_mx_shape(shape)] if _mx_shape(shape) else [])
        return key + "_scale", [[shape[0], 1], [shape[0]]]

    def _int4_layout(self, key: str) -> str | None:
        """How the packed INT4 weight named like ``key`` (``....weight``) is stored, if it is."""
        base = key.removesuffix("weight")
        for layout, suffix in (("packed", "weight_packed"), ("gptq", "qweight")):
            if base + suffix in self.reader:
                return layout
        return None

    def _int4_scale_key(self, key: str) -> str:
        """The scales of the packed INT4 weight named like ``key``."""
        suffix = "weight_scale" if self._int4_layout(key) == "packed" else "scales"
        return key.removesuffix("weight") + suffix

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
            if key + "_scale_2" in self.reader:
                stored.append(self._read_nvfp4(key))
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
        config = read_json(config_file) if config_file.is_file() else {}
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
        """A scale tensor as float32 (E8M0 ones decoded exactly), refused unless every value is finite
        and positive."""
        scale = self.reader.read(key)
        scale = (
            formats.e8m0_to_float(scale)
            if scale.dtype in (torch.uint8, torch.float8_e8m0fnu)
            else scale.float()
        )
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise CheckpointError(
                f"tensor {key!r} holds the scale {scale[tuple(where)].item()} at index {where}: scales must "
                "be finite and positive"
            )
        return scale

    def _read_weight(self, key: str) -> torch.Tensor:
        if key + "_scale_2" in self.reader:
            return formats.FP8.dequantize(*self._read_nvfp4(key))
        weight = self.reader.read(key)
        if weight.dtype != torch.float8_e4m3fn:
            return weight
        scale_key = self._fp8_scale(key, list(weight.shape))[0]
        if not scale_key.endswith("_scale_inv"):
            return weight.float() * self.reader.read(scale_key).float().reshape(-1, 1)
        scale = self._read_scale(scale_key)
        if list(scale.shape) == _mx_shape(list(weight.shape)):  # MXFP8: per 32 inputs of a row
            return weight.float() * scale.repeat_interleave(formats.MX_BLOCK, dim=1)
        return dequantize_fp8_blocks(weight, scale)


def read_source_layer(
    path: str | Path, layer: int, experts: Experts, fmt: formats.WeightFormat
) -> dict[str, torch.Tensor]:
    """One layer of a Hugging Face model directory, tensor by tensor, stored values as they are:
    BF16 (F16, F32) weights; FP8 codes with their scales (``weight_scale_inv`` per 128 x 128 block,
    or ``weight_scale`` per output channel); INT4 as compressed-tensors packs it (``weight_packed``,
    RAWINT4) or GPTQ does (``qweight``), as INT4 values, scales and (asymmetric GPTQ) zero points.
    ValueError when the weights on disk are not in ``fmt``; NotImplementedError for a format this
    reader does not take from a source directory."""
    require_source_format(path, fmt)
    return read_source_experts(*source_layer(path, layer, fmt, index_checkpoint(path)), experts)


def require_source_format(path: str | Path, fmt: formats.WeightFormat) -> None:
    """NotImplementedError for a format that is not read from a Hugging Face directory (the registry
    names no source dtypes for it). Checked before the directory is indexed."""
    if not fmt.source_dtypes:
        raise NotImplementedError(
            f"{fmt.name} weights are read from converted checkpoints: convert {path} first with "
            f"`kt-kernel convert {path} OUTPUT_DIR --format {fmt.name.lower()}`"
        )


def stored_format(dtypes: frozenset[str]) -> formats.WeightFormat:
    """The format a layer stored in ``dtypes`` (MoELayer.dtypes) is in, by the registry's source
    dtypes: a quantized one where the layer holds its dtypes (float weights beside them are read as
    they are), else the float one. A layer holding two quantized formats' dtypes, which no loader
    takes, counts as the one of wider values."""
    held = [fmt for fmt in formats.FORMATS.values() if dtypes & set(fmt.source_dtypes)]
    return max(held, key=lambda fmt: (bool(fmt.scale_groups), fmt.value_bits))


def source_layer(
    path: str | Path, layer: int, fmt: formats.WeightFormat, files: dict[str, Path]
) -> tuple[ExpertSource, MoELayer]:
    """The experts of one layer of a Hugging Face model directory, found and checked (headers only).
    ``files``: the directory's index_checkpoint."""
    source = ExpertSource(Path(path), files)
    with source.opened():
        if layer not in source.experts:
            raise CheckpointError(f"{path} holds no routed experts of layer {layer}")
        described = source.describe(layer)
    on_disk = stored_format(described.dtypes).name
    if on_disk != fmt.name:
        stored = ", ".join(sorted(described.dtypes))
        raise ValueError(f"{path} layer {layer} holds {on_disk} experts ({stored}), not {fmt.name}")
    return source, described


def read_source_experts(
    source: ExpertSource,
    described: MoELayer,
    experts: Experts,
    threads: int | None = None,
    buffers: load_threads.PartBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """The experts' stored tensors, stacked (in ``buffers``' memory where given): the first expert's
    shapes size them, the others are read into them on ``threads`` threads (load_threads.each)."""
    experts = expert_range(experts)
    if described.experts < experts.stop:
        raise CheckpointError(
            f"{source.path} layer {described.index} holds {described.experts} experts, not {experts.stop}"
        )
    result: dict[str, torch.Tensor] = {}

    def named(stored: list[tuple[torch.Tensor, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensors in zip(PROJECTIONS, stored, strict=True):
            yield from zip((name, f"{name}_scale", f"{name}_zeros"), tensors, strict=False)

    def read(index: int) -> None:
        for out, tensor in named(source.read_stored(described, experts[index])):
            result[out][index] = tensor

    with source.opened():
        for out, tensor in named(source.read_stored(described, experts.start)):
            result[out] = load_threads.empty(buffers, out, (len(experts), *tensor.shape), tensor.dtype)
            result[out][0] = tensor
        load_threads.each(read, range(1, len(experts)), threads)
    for name in PROJECTIONS:  # symmetric GPTQ: plain INT4, for the kernels without zero points
        if f"{name}_zeros" in result and not result[f"{name}_zeros"].any():
            del result[f"{name}_zeros"]
    return result
