"""Which build of kt_kernel a CPU can run: a pure function of /proc/cpuinfo text and an override.

No compiled module is imported here, so the rules can be tested with recorded cpuinfo files.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The builds, best first.
VARIANTS: tuple[str, ...] = ("amx", "avx512", "avx2")

_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
#: The cpuinfo flags each build needs (the AMX build also assumes AVX512 BF16 and VNNI).
REQUIRED_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "amx": (*_AVX512, "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"),
}

#: Override values that name a build, including upstream kt-kernel's finer AVX512 names.
OVERRIDE_ALIASES: dict[str, str] = {
    "amx": "amx",
    "avx512": "avx512",
    "avx512_bf16": "avx512",
    "avx512_vnni": "avx512",
    "avx512_vbmi": "avx512",
    "avx512_base": "avx512",
    "avx2": "avx2",
}
_AUTO = ("", "auto")

# py-cpuinfo's CPUID names that differ from the kernel's /proc/cpuinfo names.
_FLAG_SPELLINGS = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}


@dataclass(frozen=True)
class Selection:
    """The chosen build and why."""

    variant: str
    reason: str
    flags: frozenset[str]
    override: str | None


def cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """The flags that EVERY processor in a /proc/cpuinfo text reports (empty if none has a flags line)."""
    common: set[str] | None = None
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if not sep or key.strip() != "flags":
            continue
        flags = {_FLAG_SPELLINGS.get(f, f) for f in value.split()}
        common = flags if common is None else common & flags
    return frozenset(common or ())


def missing_flags(variant: str, flags: frozenset[str]) -> list[str]:
    """The flags `variant` needs that are not in `flags`, in a stable order."""
    return [f for f in REQUIRED_FLAGS[variant] if f not in flags]


def _normalize_override(override: str | None) -> str | None:
    if override is None or override.strip().lower() in _AUTO:
        return None
    name = override.strip().lower()
    if name not in OVERRIDE_ALIASES:
        valid = ", ".join(["auto", *OVERRIDE_ALIASES])
        raise ImportError(
            f"KT_KERNEL_CPU_VARIANT={override!r} is not a kt_kernel build; valid values: {valid}"
        )
    return OVERRIDE_ALIASES[name]


def explain_variant(cpuinfo_text: str, override: str | None = None) -> Selection:
    """Like select_variant, but also returns the reason and the flags it was based on."""
    flags = cpu_flags(cpuinfo_text)
    forced = _normalize_override(override)
    if forced is not None:
        missing = missing_flags(forced, flags)
        if missing:
            raise ImportError(
                f"KT_KERNEL_CPU_VARIANT={override!r} asks for the {forced} build, but this CPU lacks "
                f"{' '.join(missing)}; unset it to pick the best build automatically"
            )
        return Selection(forced, f"forced by KT_KERNEL_CPU_VARIANT={override!r}", flags, override)
    for variant in VARIANTS:
        if not missing_flags(variant, flags):
            better = VARIANTS[: VARIANTS.index(variant)]
            why = "; ".join(f"{b} needs {' '.join(missing_flags(b, flags))}" for b in better)
            reason = f"best build all processors support ({why})" if why else "best build: all flags present"
            return Selection(variant, reason, flags, override)
    if not flags:
        problem = "no x86 'flags' line was found in the CPU information (not an x86-64 CPU?)"
    else:
        problem = f"this CPU lacks {' '.join(missing_flags('avx2', flags))}"
    raise ImportError(f"kt_kernel requires an x86-64 CPU with AVX2, FMA and F16C: {problem}")


def select_variant(cpuinfo_text: str, override: str | None = None) -> str:
    """Return "amx", "avx512" or "avx2" for a /proc/cpuinfo text and a KT_KERNEL_CPU_VARIANT value.

    Uses the flags common to every processor. Raises ImportError, with a message saying what to do,
    for an unknown override, an override the CPU cannot run, or a CPU below AVX2.
    """
    return explain_variant(cpuinfo_text, override).variant


def fallback_order(variant: str) -> tuple[str, ...]:
    """`variant` and the builds below it, in the order they are tried."""
    return VARIANTS[VARIANTS.index(variant) :]
