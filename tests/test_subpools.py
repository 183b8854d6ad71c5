"""threadpool_count > 1: subpools that split the intermediate dimension, NUMA discovery and pinning.

This machine may have one NUMA node and two CPUs; the tests that pin to two nodes fake the sysfs
tree (kt_kernel.numa.SYSFS_ROOT) and check the worker threads' CPU sets as the kernel reports them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kt_kernel
from kt_kernel import formats, numa, quant
from kt_kernel.experts import intermediate_granularity, split_intermediate
from kt_kernel.info import format_cpu_info, format_numa_nodes

from moe_reference import assert_close_to_reference, make_problem, moe_wrapper, reference_forward

METHODS = list(formats.FORMATS)  # every registered format


def int8_activations(method: str) -> bool:
    """Whether the kernels for `method` quantize the activations (all but BF16's)."""
    return method != "BF16"


PROJECTIONS = ("gate", "up", "down")


def forward(p, pools: int, method: str = "BF16", scales: dict | None = None, **overrides) -> torch.Tensor:
    """The wrapper's output for problem p with `pools` subpools (float weights, or canonical ones)."""
    experts, top_k, hidden, inter = p.shape
    moe = moe_wrapper(experts, top_k, hidden, inter, method=method, threadpool_count=pools, **overrides)
    if scales is None:
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    else:
        moe.load_weights_from_tensors(scales["gate"], scales["up"], scales["down"], **scales["scales"])
    return moe.forward(p.hidden, p.ids, p.weights)


def assert_within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16 a and b differ by at most one bf16 ulp of the larger magnitude (plus 1e-6 of the rms
    for values near zero, where fp32 cancellation decides the last bit)."""
    a, b = a.double(), b.double()
    mantissa, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    ulp = torch.exp2(exponent.double() - 8)  # bf16 keeps 8 significant bits
    slack = 1e-6 * a.pow(2).mean().sqrt()
    worst = ((a - b).abs() - ulp - slack).max().item()
    assert worst <= 0, f"differences above one bf16 ulp, max |a - b| = {(a - b).abs().max().item():.3g}"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def dequantized(p, method: str):
    """p with its weights replaced by what `method` stores (quantize, dequantize)."""
    stored = {n: quant.dequantize(method, *quant.quantize(method, getattr(p, n))) for n in PROJECTIONS}
    return dataclasses.replace(p, **stored)


# ---- one subpool vs two: same weights, same result ----------------------------------------------
@pytest.mark.parametrize("tokens", [1, 19])  # 1: small enough to run on the caller; 19: on the pools
@pytest.mark.parametrize("method", METHODS)
def test_two_subpools_match_one(method, tokens):
    p = make_problem(experts=8, top_k=2, hidden=128, inter=256, tokens=tokens, seed=tokens)
    one, two = forward(p, 1, method), forward(p, 2, method)
    if not int8_activations(method):
        # The same weights and bf16 activations; only the order of the fp32 sums over I differs
        # (each slice's down projection is summed, then the slices), so a rounding may flip.
        assert_within_one_ulp(one, two)
        return
    # Int8 activations are quantized with one scale per row and engine: a slice
    # gets its own (never coarser) scale, so both outputs carry independent ~1 % rounding noise.
    # Bound their difference, and check the split is no less accurate against the exact product.
    ref = reference_forward(dequantized(p, method))
    assert relative_error(two, one.double()) < 2.5e-2
    assert relative_error(two, ref) <= 1.1 * relative_error(one, ref)


@pytest.mark.parametrize("method,down_group", [("MXFP4", 32), ("INT4", 32), ("INT4", 64), ("INT8", None)])
def test_canonical_tensors_are_sliced_with_their_scales(method, down_group):
    """Bit-exact tensors given with scales: down scales are sliced by block (MXFP4, INT4 of any G)
    or shared (INT8's per-row scale); the result equals one subpool's."""
    p = make_problem(experts=6, top_k=2, hidden=64, inter=256, tokens=9, seed=5)
    canonical: dict = {"scales": {}}
    for name in PROJECTIONS:
        group = {"group_size": down_group} if method == "INT4" and name == "down" else {}
        values, scales = quant.quantize(method, getattr(p, name), **group)
        canonical[name], canonical["scales"][f"{name}_scale"] = values, scales
    one, two = forward(p, 1, method, canonical), forward(p, 2, method, canonical)
    if not int8_activations(method):
        assert_within_one_ulp(one, two)
    else:
        assert relative_error(two, one.double()) < 2.5e-2


def test_three_subpools_on_an_uneven_split():
    p = make_problem(experts=6, top_k=3, hidden=48, inter=80, tokens=23, seed=7)
    moe = moe_wrapper(6, 3, 48, 80, cpuinfer_threads=3, threadpool_count=3)
    assert [sp["intermediate"] for sp in moe.subpools] == [(0, 32), (32, 48), (48, 80)]
    assert [sp["threads"] for sp in moe.subpools] == [1, 1, 1]
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert_close_to_reference(out, reference_forward(p))
    assert_within_one_ulp(out, forward(p, 1))


def test_a_large_call_is_summed_on_the_subpools_threads():
    """Above 65536 outputs the partials are summed by every subpool's threads (here 3 + 2), each a
    share of 32-output units; the result must not depend on who summed what."""
    p = make_problem(experts=8, top_k=2, hidden=272, inter=64, tokens=301, seed=3)
    assert_within_one_ulp(forward(p, 1), forward(p, 2, cpuinfer_threads=5))


def test_threads_are_shared_out():
    moe = moe_wrapper(4, 2, 32, 64, cpuinfer_threads=5, threadpool_count=2)
    assert [sp["threads"] for sp in moe.subpools] == [3, 2]
    assert [len(cpus) for cpus in moe.worker_cpus()] == [3, 2]


# ---- how I is split ------------------------------------------------------------------------------
def test_split_intermediate():
    assert split_intermediate(768, 1, 128) == [(0, 768)]
    assert split_intermediate(768, 2, 128) == [(0, 384), (384, 768)]
    assert split_intermediate(768, 4, 128) == [(0, 256), (256, 384), (384, 640), (640, 768)]
    assert split_intermediate(40, 2, 16) == [(0, 16), (16, 40)]
    assert split_intermediate(17, 2, 16) == [(0, 16), (16, 17)]
    with pytest.raises(ValueError, match="cannot be split into 3"):
        split_intermediate(64, 3, 32)


def test_granularity_follows_the_format():
    assert intermediate_granularity("MXFP4", 768) == 32
    assert intermediate_granularity("INT4", 768) == 128
    assert intermediate_granularity("INT4", 96) == 32
    assert intermediate_granularity("INT4", 192) == 64
    assert intermediate_granularity("BF16", 100) == intermediate_granularity("INT8", 100) == 16


def test_bad_subpool_counts():
    with pytest.raises(ValueError, match=r"threadpool_count \(3\) cannot exceed cpuinfer_threads \(2\)"):
        moe_wrapper(4, 2, 64, 64, threadpool_count=3, cpuinfer_threads=2)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 cannot be split into 2"):
        moe_wrapper(4, 2, 64, 32, threadpool_count=2, method="MXFP4")
    with pytest.raises(ValueError, match="numa_nodes names 1 nodes but threadpool_count is 2"):
        moe_wrapper(4, 2, 64, 64, threadpool_count=2, numa_nodes=[0])


# ---- the rest of the wrapper with subpools ------------------------------------------------------
def test_submit_and_sync_with_subpools():
    p = make_problem(experts=8, top_k=2, hidden=96, inter=128, tokens=40, seed=9)
    moe = moe_wrapper(8, 2, 96, 128, threadpool_count=2)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    expected = moe.forward(p.hidden, p.ids, p.weights)
    moe.submit_forward(p.hidden, p.ids, p.weights)
    with pytest.raises(RuntimeError, match="in flight"):
        moe.submit_forward(p.hidden, p.ids, p.weights)
    with pytest.raises(RuntimeError, match="in flight"):
        moe.worker_cpus()
    assert torch.equal(moe.sync_forward(p.hidden), expected)
    empty = moe.forward(p.hidden[:0], p.ids[:0], p.weights[:0])
    assert empty.shape == (0, 96)
    kt_kernel.KTMoEWrapper.clear_buffer_cache()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), expected)
    bad = p.ids.clone()
    bad[3, 1] = 8
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 8"):
        moe.forward(p.hidden, bad, p.weights)
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), expected)  # usable after the error


def test_gpu_mask_and_slot_map_with_subpools():
    p = make_problem(experts=5, top_k=3, hidden=64, inter=96, tokens=30, seed=11)
    slot_map = torch.tensor([4, 0, 2, 2, 1, 3, 0, 4])  # 8 slots over 5 source experts
    p.ids = torch.rand(30, 8, generator=torch.Generator().manual_seed(1)).argsort(dim=1)[:, :3]
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[2, 5]] = True
    outs = []
    for pools in (1, 2):
        moe = moe_wrapper(8, 3, 64, 96, threadpool_count=pools, gpu_experts_mask=mask)
        moe.load_weights_from_tensors(p.gate, p.up, p.down, physical_to_logical_map_cpu=slot_map)
        outs.append(moe.forward(p.hidden, p.ids, p.weights))
    assert_close_to_reference(outs[1], reference_forward(p, skip=mask, slot_map=slot_map))
    assert_within_one_ulp(outs[0], outs[1])


def test_load_weights_from_a_checkpoint_with_subpools(tmp_path):
    p = make_problem(experts=4, top_k=2, hidden=64, inter=128, tokens=7, seed=13)
    named, canonical = {}, {"scales": {}}
    for name, short in {"gate": "w1", "up": "w3", "down": "w2"}.items():
        codes, scales = quant.quantize("MXFP4", getattr(p, name))
        canonical[name], canonical["scales"][f"{name}_scale"] = codes, scales
        for e in range(4):
            named[f"layers.0.ffn.experts.{e}.{short}.weight"] = codes[e].view(torch.int8).clone()
            named[f"layers.0.ffn.experts.{e}.{short}.scale"] = scales[e].clone()
    save_file(named, str(tmp_path / "model.safetensors"))
    moe = moe_wrapper(4, 2, 64, 128, method="MXFP4", threadpool_count=2, weight_path=str(tmp_path))
    moe.load_weights()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), forward(p, 2, "MXFP4", canonical))


# ---- NUMA: discovery and pinning -----------------------------------------------------------------
def fake_sysfs(root: Path, nodes: dict[int, str]) -> Path:
    """A sysfs tree with devices/system/node/node<i>/cpulist = nodes[i], plus entries to ignore."""
    node_dir = root / numa.NODE_DIR
    node_dir.mkdir(parents=True)
    (node_dir / "possible").write_text("0-7\n")
    (node_dir / "power").mkdir()
    for node, cpulist in nodes.items():
        (node_dir / f"node{node}").mkdir()
        (node_dir / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    return root


def test_discover_nodes_from_a_fake_tree(tmp_path):
    root = fake_sysfs(tmp_path, {1: "4-7", 0: "0-3,8", 2: ""})
    assert numa.discover_nodes(root) == {0: [0, 1, 2, 3, 8], 1: [4, 5, 6, 7], 2: []}
    assert list(numa.discover_nodes(root)) == [0, 1, 2]
    assert numa.discover_nodes(tmp_path / "no-sysfs") == {}
    text = "3 (node 0: CPUs 0-3,8; node 1: CPUs 4-7; node 2: CPUs -)"
    assert format_numa_nodes(numa.discover_nodes(root)) == text


def test_cpulists():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []
    assert numa.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    for bad in ("0-", "a", "3-1"):
        with pytest.raises(ValueError, match="not a CPU list"):
            numa.parse_cpulist(bad)


def test_plan_pinning():
    nodes = {0: [0, 1], 1: [2, 3], 2: []}
    every = {0, 1, 2, 3}
    assert numa.plan_pinning(2, None, nodes, every) == [(0, [0, 1]), (1, [2, 3])]
    assert numa.plan_pinning(1, None, nodes, every) == [None]  # one pool keeps the whole machine
    assert numa.plan_pinning(3, None, nodes, every) == [None] * 3  # node 2 has no CPUs
    assert numa.plan_pinning(2, None, nodes, {0, 1}) == [None, None]  # node 1's CPUs are not ours
    assert numa.plan_pinning(2, [1, 1], nodes, {1, 2}) == [(1, [2]), (1, [2])]
    assert numa.plan_pinning(1, [0], {}, {0, 1}) == [(0, [0, 1])]  # no NUMA in the kernel: one node
    with pytest.raises(ValueError, match="NUMA node 5, which this machine lacks"):
        numa.plan_pinning(2, [0, 5], nodes, every)
    with pytest.raises(ValueError, match="NUMA node 2 has no CPU this process may run on"):
        numa.plan_pinning(1, [2], nodes, every)


def test_numa_nodes_pin_to_node_cpus():
    nodes = numa.discover_nodes()
    if 0 not in nodes:
        pytest.skip("this kernel reports no NUMA node 0")
    node0 = sorted(set(nodes[0]) & os.sched_getaffinity(0))
    moe = moe_wrapper(4, 2, 64, 64, threadpool_count=2, numa_nodes=[0, 0])
    assert [(sp["numa_node"], sp["cpus"]) for sp in moe.subpools] == [(0, node0), (0, node0)]
    assert moe.worker_cpus() == [[node0], [node0]]


def test_a_missing_node_is_named():
    missing = max(numa.discover_nodes(), default=0) + 7
    with pytest.raises(ValueError, match=f"NUMA node {missing}"):
        moe_wrapper(4, 2, 64, 64, threadpool_count=2, numa_nodes=[0, missing])


def test_subpools_are_pinned_to_their_nodes(tmp_path, monkeypatch):
    """Two fake nodes of one CPU each: without numa_nodes, subpool i is pinned to node i, and each
    worker thread reads back (sched_getaffinity) exactly its node's CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {0: str(cpus[0]), 1: str(cpus[1])}))
    p = make_problem(experts=4, top_k=2, hidden=64, inter=64, tokens=50, seed=17)
    moe = moe_wrapper(4, 2, 64, 64, threadpool_count=2)
    assert [(sp["numa_node"], sp["cpus"]) for sp in moe.subpools] == [(0, [cpus[0]]), (1, [cpus[1]])]
    assert moe.worker_cpus() == [[[cpus[0]]], [[cpus[1]]]]
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))
    unpinned = moe_wrapper(4, 2, 64, 64, threadpool_count=1)
    assert unpinned.subpools[0]["cpus"] is None
    assert unpinned.worker_cpus() == [[cpus, cpus]]


def test_info_reports_numa_nodes():
    info = kt_kernel.cpu_info()
    assert info["numa_nodes"] == numa.discover_nodes()
    assert info["allowed_cpus"] == sorted(os.sched_getaffinity(0))
    assert "NUMA nodes        : " in format_cpu_info(info)
