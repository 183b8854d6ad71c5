"""What kt_kernel found on this CPU and why it chose its build: cpu_info() and `python -m kt_kernel info`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import numa
from ._native import build, ext
from .loader import REQUIRED_FLAGS, VARIANTS


def builds_present() -> list[str]:
    """The builds whose compiled module is in the installed package, best first."""
    package_dir = Path(__file__).parent
    return [v for v in VARIANTS if any(package_dir.glob(f"_kt_kernel_{v}.*"))]


def cpu_info() -> dict[str, Any]:
    """A dict describing the choice of build (flags, builds present, choice, reason, override) and
    the machine's NUMA nodes with their CPUs (``numa_nodes``; {} where the kernel reports none)."""
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
        "numa_nodes": numa.discover_nodes(),
        "allowed_cpus": sorted(numa.allowed_cpus()),
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
        # One line per registered format (the build reports each format's path).
        *(
            f"{key.removesuffix('_path') + ' kernel':<18}: {path}"
            for key, path in info["kernels"].items()
            if key.endswith("_path")
        ),
        f"NUMA nodes        : {format_numa_nodes(info['numa_nodes'])}",
        f"CPUs allowed here : {numa.format_cpulist(info['allowed_cpus'])}",
    ]
    if info["selected"] != info["variant"]:
        lines.insert(2, f"selected first    : {info['selected']} (failed to load, fell back)")
    lines += [f"fallback          : {line}" for line in info["fallbacks"]]
    return "\n".join(lines)


def format_numa_nodes(nodes: dict[int, list[int]]) -> str:
    """``{0: [0, 1], 1: [2, 3]}`` -> ``"2 (node 0: CPUs 0-1; node 1: CPUs 2-3)"``."""
    if not nodes:
        return f"none reported (no {numa.SYSFS_ROOT / numa.NODE_DIR})"
    listed = "; ".join(f"node {node}: CPUs {numa.format_cpulist(cpus)}" for node, cpus in nodes.items())
    return f"{len(nodes)} ({listed})"
