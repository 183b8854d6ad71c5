"""Threads for the work load_weights() does in Python on every weight of a layer: copying experts out
of mapped files, decoding NVFP4 codes and ggml blocks. torch's, numpy's and the compiled helpers'
loops release the GIL, so a few threads share that work as the engine's pool shares the packing."""

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
