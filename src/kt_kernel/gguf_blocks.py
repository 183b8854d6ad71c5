"""ggml's quantized blocks -> the GGUF engine format's canonical tensors: one job, the bit unpacking.

Every supported ggml type is, exactly, an integer per weight times a scale plus a min per group of
G inputs (G = 16 or 32): ``w[k] = q[k] * scale[k // G] + min[k // G]``. ``convert_rows`` turns rows
of a type's blocks (uint8 ``[..., K / block_inputs * block_bytes]``) into

- values int8 ``[..., K]`` (the integer part, -128..127) and
- pairs float32 ``[..., 2 * K / G]``: ``pairs[..., 2 * g]`` the scale of group g, ``[..., 2 * g + 1]``
  its min, each the exact real value ggml means (fp16 d times a small integer fits float32).

The unpacking mirrors gguf-py's numpy dequantize (gguf.quants) but keeps the integer and the
scale/min apart. BLOCK_TYPES is the registry: a type missing from it is not supported. Numpy only:
this module needs no gguf package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import load_threads

#: kvalues_iq4nl: IQ4_NL's and IQ4_XS's 16 levels.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
#: E2M1's values doubled (kvalues_mxfp4): integers, the halving goes into the scale.
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
_SHIFTS_2BIT = np.array([0, 2, 4, 6], np.uint8)[:, None]
_SHIFTS_1BIT = np.arange(8, dtype=np.uint8)[:, None]

Blocks = np.ndarray  # uint8 [M, block_bytes]
Converted = tuple[np.ndarray, np.ndarray]  # int8 [M, block_inputs], float32 [M, 2 * block_inputs / G]


@dataclass(frozen=True)
class BlockType:
    """One ggml type: its block (inputs and bytes, as ggml's GGML_QUANT_SIZES), the inputs per
    (scale, min) pair, the function from blocks to (values, pairs), and how the engine holds it
    (src/core/kernels.h): a value in ``held_bits`` (2, 3, 5 or 6 where the values span 4, 8, 32 or 64
    integers: value planes; else 4 where they are at most 16 levels: the engine indexes them); a min
    only where the type has them (``mins``); the scales ``factored``, as multiples of
    ``multiple_bits`` (the type's 4 or 6 bits, else 8) of one fp16 per 256 inputs, where the type's scales are
    small integers times one fp16 per block (None: where the data allows, which the engine checks at
    load); else each scale and min an fp16 where ``half`` (the type's are), else a float32. The
    engine checks each choice on the data at load and falls back to float32 where it is not exact (a
    corrupt fp16 field, say)."""

    block_inputs: int
    block_bytes: int
    group: int
    convert: Callable[[Blocks], Converted]
    held_bits: int = 8
    mins: bool = False
    factored: bool | None = False
    half: bool = True
    multiple_bits: int = 8

    def held_bytes_per_weight(self) -> float:
        """The engine's bytes per weight (None ``factored``: as float32 scales, the most it takes)."""
        half = self.half and self.factored is not None
        return held_bytes_per_weight(
            self.held_bits, self.group, self.mins, bool(self.factored), half, self.multiple_bits
        )


def held_bytes_per_weight(
    held_bits: int, group: int, mins: bool, factored: bool, half: bool = False, multiple_bits: int = 8
) -> float:
    """Bytes per weight the engine holds GGUF's values and scales in (kernels.h), its rounding aside:
    a value in ``held_bits``; per group a scale, and a min where there are mins, each a float32 (an
    fp16 where ``half``), or where ``factored`` a multiple of ``multiple_bits`` plus a float32 (an
    fp16 where ``half``) per 256 inputs."""
    entries = 2 if mins else 1
    number = 2 if half else 4
    if factored:
        return held_bits / 8 + entries * (multiple_bits / 8 / group + number / 256)
    return held_bits / 8 + entries * number / group


def held_value_bits(bits: int, group: int) -> int:
    """The bits the engine holds values of ``bits`` bits in, with ``group`` inputs per scale
    (src/core/formats/gguf.cpp, where the data does not take fewer): 2 or 3-bit planes, 4-bit indices,
    5-bit planes where a group is whole 32s (else 6), 6-bit planes, else bytes."""
    if bits <= 4:
        return max(bits, 2)
    if bits == 5 and group % 32 == 0:
        return 5
    return 6 if bits <= 6 else 8


def _f16(field: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields [M, 2] -> float32 [M] (exact)."""
    return np.ascontiguousarray(field).view(np.float16)[:, 0].astype(np.float32)


def _pairs(scale: np.ndarray, minimum: np.ndarray | float = 0.0) -> np.ndarray:
    """Scales and mins [M, groups] (a min may be a scalar) -> interleaved float32 [M, 2 * groups]."""
    pairs = np.empty((*scale.shape, 2), np.float32)
    pairs[..., 0] = scale
    pairs[..., 1] = minimum
    return pairs.reshape(scale.shape[0], -1)


def _low_then_high(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> nibbles [..., 2n]: the n low nibbles, then the n high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed: np.ndarray, shifts: np.ndarray, mask: int) -> np.ndarray:
    """Bytes [M, n] -> [M, len(shifts) * n]: every byte's field at each shift, shift-major."""
    return ((packed[:, None, :] >> shifts) & mask).reshape(packed.shape[0], -1)


def _k_scales_and_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (get_scale_min)."""
    d, m, low = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(blocks: Blocks) -> Converted:
    return blocks[:, 2:].view(np.int8), _pairs(_f16(blocks[:, 0:2])[:, None])


def _q4_0(blocks: Blocks) -> Converted:
    q = _low_then_high(blocks[:, 2:]).view(np.int8) - np.int8(8)
    return q, _pairs(_f16(blocks[:, 0:2])[:, None])


def _q4_1(blocks: Blocks) -> Converted:
    q = _low_then_high(blocks[:, 4:]).view(np.int8)
    return q, _pairs(_f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None])


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 low bits from the nibbles, bit j of the 32-bit qh the fifth bit of value j."""
    high = np.unpackbits(qh, axis=-1, bitorder="little")
    return (_low_then_high(qs) | (high << 4)).view(np.int8)


def _q5_0(blocks: Blocks) -> Converted:
    return _five_bit(blocks[:, 2:6], blocks[:, 6:]) - np.int8(16), _pairs(_f16(blocks[:, 0:2])[:, None])


def _q5_1(blocks: Blocks) -> Converted:
    d, m = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
    return _five_bit(blocks[:, 4:8], blocks[:, 8:]), _pairs(d, m)


def _q2_k(blocks: Blocks) -> Converted:
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82])[:, None], _f16(blocks[:, 82:84])[:, None]
    q = _two_bit(qs).view(np.int8)
    return q, _pairs(d * (scales & 0x0F).astype(np.float32), -(dmin * (scales >> 4).astype(np.float32)))


def _two_bit(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: 64 bytes -> 256 2-bit values, per 32 bytes the four shifts in turn."""
    m = qs.shape[0]
    return ((qs.reshape(m, 2, 1, 32) >> _SHIFTS_2BIT) & 3).reshape(m, 256)


def _q3_k(blocks: Blocks) -> Converted:
    hmask, qs, packed = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])[:, None]
    low = _low_then_high(packed[:, 0:8])
    high = _bits(packed[:, 8:12], _SHIFTS_2BIT, 3)
    sc = (low | (high << 4)).astype(np.float32) - 32
    # A clear hmask bit subtracts 4: the values are -4..3.
    q = _two_bit(qs).view(np.int8) - ((_bits(hmask, _SHIFTS_1BIT, 1) ^ 1) << 2).view(np.int8)
    return q, _pairs(d * sc)


def _nibble_pairs_of_32(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes -> 256 nibbles; per 32 bytes the low nibbles, then the high ones."""
    return _low_then_high(qs.reshape(qs.shape[0], 4, 32)).reshape(qs.shape[0], 256)


def _q4_k(blocks: Blocks) -> Converted:
    d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
    sc, mn = _k_scales_and_mins(blocks[:, 4:16])
    return _nibble_pairs_of_32(blocks[:, 16:]).view(np.int8), _pairs(d * sc, -(dmin * mn))


def _q5_k(blocks: Blocks) -> Converted:
    d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
    sc, mn = _k_scales_and_mins(blocks[:, 4:16])
    q = _nibble_pairs_of_32(blocks[:, 48:]) | (_bits(blocks[:, 16:48], _SHIFTS_1BIT, 1) << 4)
    return q.view(np.int8), _pairs(d * sc, -(dmin * mn))


def _q6_k(blocks: Blocks) -> Converted:
    m = blocks.shape[0]
    ql, qh, scales = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks[:, 208:210])[:, None]
    low = _low_then_high(ql.reshape(m, 2, 64)).reshape(m, 256)
    high = ((qh.reshape(m, 2, 1, 32) >> _SHIFTS_2BIT) & 3).reshape(m, 256)
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    return q, _pairs(d * scales.view(np.int8).astype(np.float32))


def _iq4_nl(blocks: Blocks) -> Converted:
    return IQ4_LEVELS[_low_then_high(blocks[:, 2:])], _pairs(_f16(blocks[:, 0:2])[:, None])


def _iq4_xs(blocks: Blocks) -> Converted:
    m = blocks.shape[0]
    d = _f16(blocks[:, 0:2])[:, None]
    high_bits = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")
    high = (high_bits >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    packed_low = blocks[:, 4:8]
    low = np.stack([packed_low & 0x0F, packed_low >> 4], axis=-1).reshape(
        m, 8
    )  # byte 0 low, byte 0 high, ...
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    q = IQ4_LEVELS[_low_then_high(blocks[:, 8:].reshape(m, 8, 16)).reshape(m, 256)]
    return q, _pairs(d * ls)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponents -> 2^(e - 128) as float32 (ggml_e8m0_to_fp32_half: denormal for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.view(np.float32)


def _mxfp4(blocks: Blocks) -> Converted:
    return E2M1_DOUBLED[_low_then_high(blocks[:, 1:])], _pairs(_e8m0_half(blocks[:, 0:1]))


def _ue4m3_half(x: np.ndarray) -> np.ndarray:
    """Unsigned E4M3 scales -> their value halved, float32, exactly (gguf's NVFP4.ue4m3_to_fp32:
    0x7F, and 0, read as 0)."""
    exponent = ((x >> 3) & 0x0F).astype(np.int32)
    mantissa = (x & 0x07).astype(np.float32)
    value = np.where(exponent == 0, np.ldexp(mantissa, -10), np.ldexp(1 + mantissa / 8, exponent - 8)).astype(
        np.float32
    )
    return np.where((x == 0) | (x == 0x7F), np.float32(0), value)


def _nvfp4(blocks: Blocks) -> Converted:
    m = blocks.shape[0]
    codes = _low_then_high(blocks[:, 4:].reshape(m, 4, 8)).reshape(m, 64)  # per 16: 8 low nibbles, 8 high
    return E2M1_DOUBLED[codes], _pairs(_ue4m3_half(blocks[:, 0:4]))


#: The supported ggml types by name (gguf.GGMLQuantizationType's names). Blocks as ggml defines them.
BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(32, 34, 32, _q8_0),
    "Q4_0": BlockType(32, 18, 32, _q4_0, held_bits=4),
    "Q4_1": BlockType(32, 20, 32, _q4_1, held_bits=4, mins=True),
    "Q5_0": BlockType(32, 22, 32, _q5_0, held_bits=5),
    "Q5_1": BlockType(32, 24, 32, _q5_1, held_bits=5, mins=True),
    "Q2_K": BlockType(256, 84, 16, _q2_k, held_bits=2, mins=True, factored=True, multiple_bits=4),
    "Q3_K": BlockType(256, 110, 16, _q3_k, held_bits=3, factored=True, multiple_bits=6),
    "Q4_K": BlockType(256, 144, 32, _q4_k, held_bits=4, mins=True, factored=True, multiple_bits=6),
    "Q5_K": BlockType(256, 176, 32, _q5_k, held_bits=5, mins=True, factored=True, multiple_bits=6),
    "Q6_K": BlockType(256, 210, 16, _q6_k, held_bits=6, factored=True),
    "IQ4_NL": BlockType(32, 18, 32, _iq4_nl, held_bits=4),
    "IQ4_XS": BlockType(256, 136, 32, _iq4_xs, held_bits=4, factored=True, multiple_bits=6),
    "MXFP4": BlockType(32, 17, 32, _mxfp4, held_bits=4, factored=None, half=False),
    "NVFP4": BlockType(64, 36, 16, _nvfp4, held_bits=4, factored=None, half=False),
}

#: Blocks converted at a time: the temporaries stay a few MiB.
_CHUNK_BLOCKS = 8192


def convert_rows(type_name: str, raw: np.ndarray, threads: int | None = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ggml blocks, uint8 ``[..., row bytes]`` -> (values int8 ``[..., K]``, pairs float32
    ``[..., 2 * K / G]``), as the module docstring says, _CHUNK_BLOCKS at a time on ``threads``
    threads (load_threads.each; numpy releases the GIL in its loops). ValueError for a type not in
    BLOCK_TYPES or a row that is not whole blocks."""
    block = BLOCK_TYPES.get(type_name)
    if block is None:
        raise ValueError(f"ggml type {type_name} is not supported; supported: {', '.join(BLOCK_TYPES)}")
    *lead, row_bytes = raw.shape
    if row_bytes % block.block_bytes:
        raise ValueError(f"{type_name} rows of {row_bytes} bytes are not whole blocks of {block.block_bytes}")
    blocks = raw.reshape(-1, block.block_bytes)
    per_block = block.block_inputs // block.group
    values = np.empty((blocks.shape[0], block.block_inputs), np.int8)
    pairs = np.empty((blocks.shape[0], 2 * per_block), np.float32)

    # A corrupt fp16 field (Inf, NaN) gives a non-finite pair, which the caller reports, not numpy.
    def convert(start: int) -> None:
        with np.errstate(invalid="ignore", over="ignore"):  # numpy's error state is per thread
            part = np.ascontiguousarray(blocks[start : start + _CHUNK_BLOCKS])
            values[start : start + len(part)], pairs[start : start + len(part)] = block.convert(part)

    load_threads.each(convert, range(0, blocks.shape[0], _CHUNK_BLOCKS), threads)
    k = row_bytes // block.block_bytes * block.block_inputs
    return values.reshape(*lead, k), pairs.reshape(*lead, 2 * k // block.group)
