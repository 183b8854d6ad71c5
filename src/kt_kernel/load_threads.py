"""Threads and memory for the work load_weights() does in Python on every weight of a layer: copying
experts out of mapped files, decoding NVFP4 codes and ggml blocks. torch's, numpy's and the compiled
helpers' loops release the GIL, so a few threads share that work as the engine's pool shares the
packing; and a part's tensors can be the last part's memory again (PartBuffers), not fresh pages."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    """Threads where the caller names none: torch's intra-op threads."""
    return max(1, torch.get_num_threads())


def each(function: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> list[R]:
    """``function(item)`` for every item on up to ``threads`` threads (None: default_threads()): the
    results in order. An error is raised as a loop would raise it: the first failing item's, in
    order. The threads are started per call, never kept: a forked child has none of its parent's."""
    items = list(items)
    workers = min(threads or default_threads(), len(items))
    if workers <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="kt-load") as pool:
        return list(pool.map(function, items))


class PartBuffers:
    """The tensors a load reads each part into, kept for the next part: fresh memory costs a page
    fault (and the kernel's zeroing) per page, and on a virtual machine more, as much again as
    copying into it. Only for a caller that is done with a part's tensors before it reads the next."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor: ``name``'s of the last part where it has this shape and dtype."""
        held = self._held.get(name)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = self._held[name] = torch.empty(shape, dtype=dtype)
        return held


def empty(buffers: PartBuffers | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``buffers.empty(...)``, or a new tensor without buffers."""
    return torch.empty(shape, dtype=dtype) if buffers is None else buffers.empty(name, shape, dtype)
