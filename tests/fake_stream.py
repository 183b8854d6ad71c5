"""The stand-in CUDA runtime of tests/fake_cuda, built and driven from Python (a test tool: it proves
ordering and logic, never the GPU path)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

FAKE_SOURCE = Path(__file__).resolve().parent / "fake_cuda" / "fake_cudart.c"


def build_fake(directory) -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in CUDA runtime")
    library = str(directory / "libfake_cudart.so")
    subprocess.run(
        [compiler, "-O1", "-shared", "-fPIC", "-pthread", "-o", library, str(FAKE_SOURCE)], check=True
    )
    return library


class Fake:
    """The stand-in runtime's test controls."""

    def __init__(self, library: str) -> None:
        self.path = library
        self.lib = ctypes.CDLL(library)
        self.lib.fake_stream_create.restype = ctypes.c_size_t
        for name in ("hold", "release", "drain", "executed", "queued"):
            getattr(self.lib, f"fake_stream_{name}").argtypes = [ctypes.c_size_t]
        for name in ("capture_begin", "capture_end"):
            getattr(self.lib, f"fake_{name}").argtypes = [ctypes.c_size_t]
        self.lib.fake_capture_end.restype = ctypes.c_void_p
        self.lib.fake_graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        for name in ("executed", "queued"):
            getattr(self.lib, f"fake_stream_{name}").restype = ctypes.c_long
        self.lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                             ctypes.c_size_t]  # fmt: skip

    def stream(self) -> int:
        return self.lib.fake_stream_create()

    def hold(self, stream: int) -> None:
        self.lib.fake_stream_hold(stream)

    def release(self, stream: int) -> None:
        self.lib.fake_stream_release(stream)

    def drain(self, stream: int) -> None:
        self.lib.fake_stream_drain(stream)

    def executed(self, stream: int) -> int:
        return self.lib.fake_stream_executed(stream)

    def queued(self, stream: int) -> int:
        return self.lib.fake_stream_queued(stream)

    def capture_begin(self, stream: int) -> None:
        self.lib.fake_capture_begin(stream)

    def capture_end(self, stream: int) -> int:
        """The graph recorded on `stream` since capture_begin."""
        return self.lib.fake_capture_end(stream)

    def replay(self, graph: int, stream: int) -> None:
        self.lib.fake_graph_launch(graph, stream)

    def read(self, tensor: torch.Tensor, stream: int) -> torch.Tensor:
        """A copy of `tensor` made in stream order (as the caller's next GPU kernel would read it)."""
        copy = torch.empty_like(tensor)
        size = tensor.numel() * tensor.element_size()
        self.lib.cudaMemcpyAsync(copy.data_ptr(), tensor.data_ptr(), size, 4, stream)
        return copy
