"""A layer mapped from mmap_experts_dir is file pages, not anonymous memory: loading it adds little
RssAnon, and processes mapping one cache share its pages (each one's Pss of the file is its share)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_fp8 import write_model_dir

from kt_kernel.bench_load import cache_file_pages

from conftest import REPO

E, H, I = 16, 1024, 512  # BF16: 48 MiB packed
SANITIZED = "asan" in os.environ.get("LD_PRELOAD", "")  # CI's sanitizer pass (ci/run_sanitizers.sh)

HOLD = """
import json, sys, time
sys.path.insert(0, "tests")
from moe_reference import moe_wrapper

def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) * 1024

moe = moe_wrapper(16, 2, 1024, 512, weight_path=sys.argv[1], mmap_experts_dir=sys.argv[2] or None)
before, start = status("RssAnon:"), time.perf_counter()
moe.load_weights()
seconds = time.perf_counter() - start
engines = [sp.engine for sp in moe._subpools]
print(json.dumps({"anon": status("RssAnon:") - before, "packed": sum(e.packed_bytes() for e in engines),
                  "mapped": all(e.mapped for e in engines), "seconds": seconds}), flush=True)
sys.stdin.readline()  # the mapping is held until the test has read /proc
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(E):
        for name, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            weight = torch.randn(n, k, generator=g).bfloat16()
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = weight
    path = tmp_path_factory.mktemp("model") / "model"
    write_model_dir(path, tensors)
    return path


def start(model, cache) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")}
    launch = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(model), str(cache or "")], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    line = launch.stdout.readline()
    if not line:
        raise AssertionError(launch.communicate(timeout=60)[1][-2000:])
    return launch, json.loads(line)


def finish(launch: subprocess.Popen) -> None:
    _, err = launch.communicate("\n", timeout=60)
    assert launch.returncode == 0, err[-2000:]


def file_pages(pid: int) -> dict[str, int]:
    """Rss and Pss (bytes) of the process's mappings of the cache's files."""
    return {field: kib * 1024 for field, kib in cache_file_pages(pid).items()}


def test_mapped_layers_are_shared_file_pages(model, tmp_path):
    cache = tmp_path / "cache"
    writer, packed = start(model, cache)  # packs and writes: anonymous, as without a cache
    finish(writer)
    assert not packed["mapped"] and packed["anon"] > 0.9 * packed["packed"]
    first, one = start(model, cache)
    second, two = start(model, cache)
    try:
        for figures in (one, two):
            assert figures["mapped"]
            # Under AddressSanitizer the resident memory is also its allocator's (quarantine, shadow).
            assert SANITIZED or figures["anon"] <= 0.05 * figures["packed"], figures
        pages = [file_pages(p.pid) for p in (first, second)]
        for mine in pages:  # every page touched at the load (placed by first touch), half of each counted
            assert mine["Rss"] >= 0.95 * one["packed"], pages
            assert mine["Pss"] <= 0.55 * mine["Rss"], pages
        shares = [(p["Rss"] >> 20, p["Pss"] >> 20) for p in pages]
        print(f"\npacked {one['packed'] >> 20} MiB: anonymous RSS added by a packing load "
              f"{packed['anon'] >> 20} MiB, by mapped loads {one['anon'] >> 10} / {two['anon'] >> 10} KiB; "
              f"file Rss/Pss per process {shares} MiB; load {packed['seconds']:.3f} s packing and writing, "
              f"{one['seconds']:.3f} / {two['seconds']:.3f} s mapped")  # fmt: skip
    finally:
        finish(first)
        finish(second)
