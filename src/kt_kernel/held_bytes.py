"""The bytes the engine holds a projection's experts in: one job, src/core's packed layouts as
arithmetic, so that memory can be told before a load (``kt-kernel info --memory``).

A projection of E experts, each a matrix of N rows (outputs) and K inputs, is held in groups of
``ext.GROUP_ROWS`` rows (the last one padded with zero rows), each group its values then its
scales (and zero points, sized as the scales): ``E * ceil(N / GROUP_ROWS) * (values + scales *
(1 + zero points))``, what ``MoEEngine.packed_bytes()`` adds up. The per-group bytes of each format
are ``group_bytes`` and ``_GROUP_BYTES``, transcribed from src/core/formats/*.cpp and kernels.h;
tests/test_memory_estimate.py holds them to the engine's ``packed_bytes()`` for every format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._native import ext

ROWS = ext.GROUP_ROWS
FLOAT_BYTES = 4
#: GGUF's factored scales: one fp32 factor per this many inputs of a row (kGgufBlockInputs).
GGUF_FACTOR_INPUTS = 256
#: GGUF's factored scales of a group, fp32 factors and int8 multiples, are padded to whole lines
#: of this many bytes (the other layouts are not padded).
GGUF_SCALE_LINE = 64
HALF_BYTES = 2


def _ceil_div(value: int, divisor: int) -> int:
    return -(-value // divisor)


def _round_up(value: int, multiple: int) -> int:
    return _ceil_div(value, multiple) * multiple


def _fp8_scales(k: int, group: int) -> int:
    """Per group: a float per scale group (one per row: group 0) of each row, then the small-code
    bitmap, a bit per input pair in whole 64-byte lines (fp8_scale_bytes, fp8_small_code_words)."""
    per_row = k // group if group else 1
    bitmap_words = _round_up(_ceil_div(_ceil_div(k, 2), 64), 8)
    return per_row * ROWS * FLOAT_BYTES + bitmap_words * 8


#: Per format, (value bytes, scale bytes) of one group of ROWS rows of k inputs with scale group g.
_GROUP_BYTES: dict[str, Callable[[int, int], tuple[int, int]]] = {
    "BF16": lambda k, g: (_round_up(k, 2) * ROWS * 2, 0),
    "FP8": lambda k, g: (_round_up(k, 2) * ROWS, _fp8_scales(k, g)),
    "INT8": lambda k, g: (_round_up(k, 4) * ROWS, ROWS * FLOAT_BYTES),
    "INT4": lambda k, g: (k // 2 * ROWS, k // g * ROWS * FLOAT_BYTES),
    "MXFP4": lambda k, g: (k // 32 * 4 * 64, k // 32 * ROWS),
}


@dataclass(frozen=True)
class GgufLayout:
    """How the engine holds a GGUF projection (HeldLayout, kernels.h): values in ``value_bits`` bits
    (8: bytes; 4: indices into 16 levels; 2, 3, 5 or 6: value planes, where they span 4, 8, 32 or 64
    integers); scales as fp32 or fp16 (``half_scales``), or factored (int8, 6 or 4-bit multiples of an fp32 or
    fp16 factor per 256 inputs); the min entries left out where every min is 0. The engine chooses
    by the data at load."""

    value_bits: int
    factored: bool
    mins: bool
    #: The scales as unsigned E4M3 bytes (NVFP4's), with an fp32 factor per matrix (no mins).
    e4m3: bool = False
    #: Unfactored: fp16 scales and mins.
    half_scales: bool = False
    #: Factored: fp16 factors, and the bits of a multiple (8, 6 or 4).
    half_factors: bool = False
    multiple_bits: int = 8


def gguf_group_bytes(k: int, group: int, layout: GgufLayout) -> tuple[int, int]:
    """(value bytes, scale bytes) of one group of ROWS GGUF rows of k inputs, scale group ``group``."""
    values = k * layout.value_bits // 8 * ROWS  # k: whole 32s
    if layout.e4m3:
        return values, k // group * ROWS
    entries = (k // group) * (2 if layout.mins else 1) * ROWS
    if not layout.factored:
        return values, entries * (HALF_BYTES if layout.half_scales else FLOAT_BYTES)
    factors = _ceil_div(k, GGUF_FACTOR_INPUTS) * (2 if layout.mins else 1) * ROWS
    factors *= HALF_BYTES if layout.half_factors else FLOAT_BYTES
    multiples = entries * layout.multiple_bits // 8
    if layout.half_factors or layout.multiple_bits != 8:
        return values, factors + multiples
    return values, _round_up(factors + multiples, GGUF_SCALE_LINE)


def projection_bytes(
    format_name: str,
    experts: int,
    rows: int,
    k: int,
    group: int = 0,
    zero_points: bool = False,
    layout: GgufLayout | None = None,
) -> int:
    """The bytes ``packed_bytes()`` counts for one projection: ``experts`` matrices of ``rows`` x
    ``k`` in format ``format_name`` (a name of formats.FORMATS), with ``group`` inputs per scale (0:
    one per row), zero points or not, and for GGUF the layout the engine chose."""
    factors = 0
    if format_name == "GGUF":
        values, scales = gguf_group_bytes(k, group, layout)
        factors = experts * FLOAT_BYTES if layout.e4m3 else 0  # one fp32 per matrix
    else:
        values, scales = _GROUP_BYTES[format_name](k, group)
    return experts * _ceil_div(rows, ROWS) * (values + scales * (1 + zero_points)) + factors


#: How the engine holds method NVFP4 (formats.nvfp4_as_gguf): GGUF's 4-bit indices, E4M3 scales.
NVFP4_LAYOUT = GgufLayout(value_bits=4, factored=False, mins=False, e4m3=True)


def nvfp4_bytes(experts: int, rows: int, k: int) -> int:
    """The bytes of one NVFP4 projection held as GGUF (NVFP4_LAYOUT): half a byte per weight, a byte
    per 16 inputs of a row, an fp32 per matrix: at most the file's (its fp32 weight_scale_2 per
    matrix), as long as rows fill whole groups of ROWS."""
    return projection_bytes("GGUF", experts, rows, k, 16, layout=NVFP4_LAYOUT)


def gguf_most_bytes(experts: int, rows: int, k: int, group: int, value_bits: int, mins: bool) -> int:
    """The larger of a GGUF projection's two fp32 scale layouts (unfactored or factored): the engine
    factors, or holds fp16, where the scales allow, which the headers cannot tell; every other
    layout is smaller."""
    return max(
        projection_bytes("GGUF", experts, rows, k, group, layout=GgufLayout(value_bits, factored, mins))
        for factored in (False, True)
    )
