"""What kt_kernel found on this CPU and why it chose its build: cpu_info() and `python -m kt_kernel info`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._native import build, ext
from .loader import REQUIRED_FLAGS, VARIANTS


def builds_present() -> list[str]:
    """The builds whose compiled module is in the installed package, best first."""
    package_dir = Path(__file__).parent
    return [v for v in VARIANTS if any(package_dir.glob(f"_kt_kernel_{v}.*"))]


def cpu_info() -> dict[str, Any]:
    """A dict describing the choice of build: flags, builds present, choice, reason, override."""
    relevant = sorted({flag for flags in REQUIRED_FLAGS.values() for flag in flags})
    return {
        "flags_source": build.cpuinfo_source,
        "flags": {flag: flag in build.selection.flags for flag in relevant},
        "cpuid": dict(ext.cpu_features()),
        "builds_present": builds_present(),
        "override": build.selection.override,
        "selected": build.selection.variant,
        "variant": build.variant,
        "reason": build.selection.reason,
        "fallbacks": list(build.fallbacks),
        "kernels": dict(ext.kernel_info()),
        "module_file": getattr(ext, "__file__", None),
    }


def format_cpu_info(info: dict[str, Any]) -> str:
    """cpu_info() as text for a person."""

    def flag_list(flags: dict[str, bool], present: bool) -> str:
        return " ".join(f for f, on in flags.items() if on == present) or "-"

    lines = [
        f"build in use      : {info['variant']}  ({info['module_file']})",
        f"why               : {info['reason']}",
        f"override          : KT_KERNEL_CPU_VARIANT={info['override']!r}",
        f"builds present    : {' '.join(info['builds_present'])}",
        f"flags source      : {info['flags_source']}",
        f"flags present     : {flag_list(info['flags'], True)}",
        f"flags missing     : {flag_list(info['flags'], False)}",
        f"CPUID confirms    : {flag_list(info['cpuid'], True)}",
        f"bf16 kernel path  : {info['kernels']['bf16_path']}",
    ]
    if info["selected"] != info["variant"]:
        lines.insert(2, f"selected first    : {info['selected']} (failed to load, fell back)")
    lines += [f"fallback          : {line}" for line in info["fallbacks"]]
    return "\n".join(lines)
