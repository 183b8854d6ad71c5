"""Each compiled module holds only the instructions its build may use: the AVX2 module no AVX512
(no zmm, no EVEX encoding, no mask registers), the AVX512 module no AMX. Checked by disassembly."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

import kt_kernel

LEGACY_PREFIXES = {0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x64, 0x65, 0x36, 0xF0}
AVX512_REGISTER = re.compile(r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b")
AMX_MNEMONIC = re.compile(
    r"^(ldtilecfg|sttilecfg|tilerelease|tilezero|tileloadd|tileloaddt1|tilestored|tdp\w+)$"
)


def is_evex(raw_bytes: list[int]) -> bool:
    """EVEX instructions start (after legacy prefixes) with 0x62, which is never BOUND in 64-bit mode."""
    rest = list(raw_bytes)
    while rest and rest[0] in LEGACY_PREFIXES:
        rest.pop(0)
    return bool(rest) and rest[0] == 0x62


def classify(line: str) -> set[str]:
    """The ISA classes ('avx512', 'amx') an `objdump -d` instruction line uses."""
    parts = line.split("\t")
    if len(parts) < 3 or not re.match(r"^\s*[0-9a-f]+:$", parts[0]):
        return set()
    raw = [int(b, 16) for b in parts[1].split()]
    mnemonic, _, operands = parts[2].strip().partition(" ")
    found = set()
    if is_evex(raw) or AVX512_REGISTER.search(operands):
        found.add("avx512")
    if AMX_MNEMONIC.match(mnemonic):
        found.add("amx")
    return found


@cache
def instruction_classes(variant: str) -> dict[str, list[str]]:
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    (module,) = Path(kt_kernel.__file__).parent.glob(f"_kt_kernel_{variant}.*so")
    listing = subprocess.run(
        ["objdump", "-d", "-w", str(module)], capture_output=True, text=True, check=True
    ).stdout
    hits: dict[str, list[str]] = {"avx512": [], "amx": []}
    for line in listing.splitlines():
        for isa in classify(line):
            hits[isa].append(line.strip())
    return hits


def test_classifier_recognises_encodings():
    # vaddps %zmm1,%zmm0,%zmm0 (EVEX) / vaddps %ymm1,%ymm0,%ymm0 (VEX) / vdpbf16ps with ymm (EVEX)
    assert classify("  10:\t62 f1 7c 48 58 c1 \tvaddps %zmm1,%zmm0,%zmm0") == {"avx512"}
    assert classify("  10:\tc5 fc 58 c1          \tvaddps %ymm1,%ymm0,%ymm0") == set()
    assert classify("  10:\t62 f2 7e 28 52 c1    \tvdpbf16ps %ymm1,%ymm0,%ymm0") == {"avx512"}
    assert classify("  10:\tc5 f8 90 c1          \tkmovw  %k1,%k0") == {"avx512"}
    assert classify("  10:\tc4 e2 7b 4b 04 08    \ttileloadd (%rax,%rcx,1),%tmm0") == {"amx"}


def test_avx2_module_has_no_avx512():
    hits = instruction_classes("avx2")["avx512"]
    assert not hits, f"{len(hits)} AVX512 instructions in the avx2 build, e.g. {hits[:5]}"


def test_avx512_module_has_avx512_and_no_amx():
    classes = instruction_classes("avx512")
    assert len(classes["avx512"]) > 100  # the kernels really are AVX512 (and the check sees them)
    assert not classes["amx"], classes["amx"][:5]


def test_amx_module_has_tile_code():
    classes = instruction_classes("amx")
    assert len(classes["avx512"]) > 100
    mnemonics = {line.split("\t")[-1].split()[0] for line in classes["amx"]}
    assert {"tdpbf16ps", "tileloadd", "tilestored", "ldtilecfg"} <= mnemonics, mnemonics
