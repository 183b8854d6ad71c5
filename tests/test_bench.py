"""The benchmark command runs end to end (figures are not asserted: performance lives in the command)."""

from __future__ import annotations

import json
import subprocess
import sys

from kt_kernel.loader import VARIANTS, missing_flags

from conftest import HOST_FLAGS, REPO


def test_bench_all_variants_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "bench", "--shape", "tiny", "--tokens", "1", "64", "--calls", "3",
         "--variant", "all", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    machine = data["machine"]
    assert machine["threads"] >= 1 and machine["dram_gbps"] > 0 and machine["cpu"]
    runnable = [v for v in VARIANTS if not missing_flags(v, HOST_FLAGS)]
    builds = {row["variant"].removesuffix("-plain") for row in data["rows"]}
    assert builds == set(runnable)
    for row in data["rows"]:
        assert row["median_ms"] > 0 and row["calls"] == 3 and row["torch_median_ms"] > 0
        assert (row["pct_of_bandwidth"] is None) == (row["tokens"] > 8)
        assert (row["pct_of_peak"] is None) == (row["tokens"] <= 8)
    assert "median ms" in result.stdout and "tiny" in result.stdout
