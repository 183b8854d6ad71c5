"""Subpools: a layer split along the intermediate dimension between engines with their own threads."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import formats, numa
from ._native import ext
from .loader.load import debug


def intermediate_granularity(weight_format: str, intermediate: int) -> int:
    """The multiple at which the intermediate dimension I may be cut between subpools.

    A subpool's slice of I is the input dimension of its down projection, so a cut must not split
    a scale's group of inputs (MXFP4: 32, INT4: G). Where the format allows several group sizes,
    the multiple is the largest dividing I: the group quantize-on-load uses, and a multiple of
    every group a down scale can have for this I (they are powers of two that divide I). Formats
    without groups along I could be cut anywhere; ext.GROUP_ROWS is the rows of one packed weight
    group: gate/up pack each slice's rows in such groups, so a cut off a multiple of it would leave
    a zero-padded, wasted group in two subpools.
    """
    fmt = formats.get(weight_format)
    return (fmt.choose_group(intermediate) if fmt.group_scales else 0) or ext.GROUP_ROWS


def split_intermediate(intermediate: int, count: int, granularity: int) -> list[tuple[int, int]]:
    """``count`` contiguous slices ``[start, stop)`` of ``range(intermediate)``, as even as cuts at
    multiples of ``granularity`` allow; ValueError when some slice would be empty."""
    cuts = [(2 * j * intermediate + count * granularity) // (2 * count * granularity) * granularity
            for j in range(1, count)]  # fmt: skip
    bounds = [0, *cuts, intermediate]
    slices = list(zip(bounds[:-1], bounds[1:], strict=True))
    if any(start >= stop for start, stop in slices):
        raise ValueError(
            f"moe_intermediate_size={intermediate} cannot be split into {count} non-empty subpool slices "
            f"cut at multiples of {granularity}: use a smaller threadpool_count"
        )
    return slices


# The worker threads of the process, shared by every layer as upstream's CPUInfer: one set per
# configuration (threads per subpool, their CPUs), made by the first layer that asks for it and kept
# while any layer holds it. A model gives every layer the same configuration, so it has one set.
_pools_lock = threading.Lock()
_pools: dict[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], weakref.ref] = {}


def _shared_worker_pools(threads: list[int], cpus: list[list[int]]) -> Any:
    """The process's ext.WorkerPools for threads[i] workers in subpool i pinned to cpus[i]."""
    config = (tuple(threads), tuple(tuple(c) for c in cpus))
    with _pools_lock:
        pools = _pools[config]() if config in _pools else None
        if pools is None:
            pools = ext.WorkerPools(threads, cpus)
            _pools[config] = weakref.ref(pools)
            debug(f"worker threads for subpools of {list(threads)} threads started")
        return pools


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held the lock at the fork; it does not exist here.
    global _pools_lock
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class Subpool:
    """One engine with its own threads, owning intermediate rows [start, stop) of every expert."""

    engine: Any  # ext.MoEEngine, owned by the layer's ext.MoESubpools
    start: int
    stop: int
    threads: int
    numa_node: int | None
    cpus: list[int] | None


def plan_subpools(
    *,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    weight_format: str,
    threads: int,
    count: int,
    numa_nodes: Sequence[int] | None,
    skip: list[int],
    **engine_options: Any,
) -> tuple[Any, Any, list[Subpool]]:
    """A layer of ``count`` subpools: its engines (ext.MoESubpools), the worker pools they run on
    (to hold while the layer lives) and each subpool. ``threads`` and the intermediate dimension are
    shared out as evenly as the format allows, the threads pinned by numa.plan_pinning; ``skip``:
    the experts on the GPU."""
    slices = split_intermediate(intermediate, count, intermediate_granularity(weight_format, intermediate))
    pins = numa.plan_pinning(count, numa_nodes, numa.discover_nodes(), numa.allowed_cpus())
    shares = [threads // count + (i < threads % count) for i in range(count)]
    pools = _shared_worker_pools(shares, [[] if pin is None else pin[1] for pin in pins])
    layer = ext.MoESubpools(
        num_experts, top_k, hidden, weight_format, pools, [stop - start for start, stop in slices], skip,
        **engine_options,
    )  # fmt: skip
    subpools = [
        Subpool(layer.engine(i), start, stop, share, *(pin if pin is not None else (None, None)))
        for i, ((start, stop), share, pin) in enumerate(zip(slices, shares, pins, strict=True))
    ]
    return layer, pools, subpools
