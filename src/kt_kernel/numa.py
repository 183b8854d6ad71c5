"""NUMA topology as Linux reports it in sysfs, and where each subpool of a layer is pinned.

Pure Python, no compiled module: discovery takes the sysfs root and planning the topology as
arguments, so tests feed them a fake tree.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Where the kernel's sysfs is mounted; the wrapper reads the topology from here.
SYSFS_ROOT = Path("/sys")
NODE_DIR = "devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    """A sysfs CPU list such as ``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (empty text -> [])."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"not a CPU list: {text.strip()!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"not a CPU list: {text.strip()!r}")
        cpus.extend(range(low, high + 1))
    return sorted(set(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of parse_cpulist: ``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (no CPUs -> ``"-"``)."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "-"


def discover_nodes(sysfs_root: str | Path | None = None) -> dict[int, list[int]]:
    """``{node id: its CPUs}`` from ``<sysfs_root>/devices/system/node/node*/cpulist``, by node id.

    ``sysfs_root`` defaults to ``SYSFS_ROOT``. A node without CPUs (memory only, e.g. CXL or HBM)
    maps to []. A kernel that reports no nodes (no NUMA support) gives {}.
    """
    node_dir = Path(SYSFS_ROOT if sysfs_root is None else sysfs_root) / NODE_DIR
    nodes: dict[int, list[int]] = {}
    if not node_dir.is_dir():
        return nodes
    for entry in node_dir.iterdir():
        suffix = entry.name.removeprefix("node")
        if entry.name == suffix or not suffix.isdigit():
            continue
        try:
            text = (entry / "cpulist").read_text()
        except OSError:
            continue
        nodes[int(suffix)] = parse_cpulist(text)
    return dict(sorted(nodes.items()))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; cgroups and taskset narrow it)."""
    return set(os.sched_getaffinity(0))


def plan_pinning(
    count: int,
    requested: Sequence[int] | None,
    nodes: dict[int, list[int]],
    allowed: set[int],
) -> list[tuple[int, list[int]] | None]:
    """For each of ``count`` subpools, ``(node, CPUs to pin its threads to)`` or None (not pinned).

    ``requested`` (the wrapper's ``numa_nodes``) names one node per subpool; a node may repeat.
    A node that does not exist, or none of whose CPUs this process may use, is a ValueError.
    Without ``requested``, subpool i goes to the i-th node that has CPUs this process may use,
    when ``count`` > 1 and there are that many such nodes; otherwise nothing is pinned (one pool
    keeps the whole machine). The CPUs are the node's, less those outside ``allowed``. A kernel that reports
    no nodes (built without NUMA) has one: node 0, every allowed CPU.
    """
    nodes = nodes or {0: sorted(allowed)}
    usable = {node: [cpu for cpu in cpus if cpu in allowed] for node, cpus in nodes.items()}
    if requested is None:
        candidates = [node for node, cpus in usable.items() if cpus]
        if count == 1 or len(candidates) < count:
            return [None] * count
        return [(node, usable[node]) for node in candidates[:count]]
    requested = list(requested)
    if len(requested) != count:
        raise ValueError(
            f"numa_nodes names {len(requested)} nodes but threadpool_count is {count}: "
            "name one node per subpool"
        )
    plan: list[tuple[int, list[int]] | None] = []
    for node in requested:
        if node not in nodes:
            found = ", ".join(map(str, nodes))
            raise ValueError(f"numa_nodes names NUMA node {node}, which this machine lacks (nodes: {found})")
        if not usable[node]:
            raise ValueError(
                f"NUMA node {node} has no CPU this process may run on "
                f"(node CPUs: {format_cpulist(nodes[node])}, allowed: {format_cpulist(allowed)})"
            )
        plan.append((node, usable[node]))
    return plan
