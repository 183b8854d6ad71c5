"""BF16 forward vs the PyTorch reference, on the build this process loaded.

tests/test_variants.py re-runs this file under every build the CPU can execute (and both AVX512
paths), forcing the build with KT_KERNEL_CPU_VARIANT in a subprocess.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import kt_kernel
from kt_kernel import KTMoEWrapper

from moe_reference import (
    assert_close_to_reference,
    make_problem,
    moe_wrapper,
    random_routing,
    reference_forward,
)


def make_wrapper(p, threads: int = 2, gpu_experts_mask=None, slot_map=None) -> KTMoEWrapper:
    _, top_k, hidden, inter = p.shape
    experts = len(slot_map) if slot_map is not None else p.gate.shape[0]
    moe = moe_wrapper(
        experts, top_k, hidden, inter, gpu_experts_mask=gpu_experts_mask, cpuinfer_threads=threads
    )
    if slot_map is None:
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    else:
        moe.load_weights_from_tensors(p.gate, p.up, p.down, physical_to_logical_map_cpu=slot_map)
    return moe


def test_forced_build_is_the_one_loaded():
    forced = os.environ.get("KT_KERNEL_CPU_VARIANT")
    if forced is None:
        pytest.skip("no build forced: this run tests the automatically chosen build")
    assert kt_kernel.__cpu_variant__ == forced
    path = kt_kernel.cpu_info()["kernels"]["bf16_path"]
    if os.environ.get("KT_KERNEL_DISABLE_AVX512_BF16") == "1":
        assert path.startswith("avx512f"), path
    elif os.environ.get("KT_KERNEL_FORCE_AVX512_BF16") == "1" and forced == "avx512":
        assert path == "avx512_bf16 (vdpbf16ps)", path
    elif forced == "avx2":
        assert path.startswith("avx2"), path


def test_bf16_multiply_follows_the_cpu_vendor():
    """The avx512 build multiplies bf16 rows with fp32 FMA on Intel CPUs that have AVX512_BF16 and
    with vdpbf16ps on others: a fixed rule, not a timing, so that every process computes the same
    result for the same input."""
    from conftest import HOST_FLAGS

    if kt_kernel.__cpu_variant__ != "avx512" or "avx512_bf16" not in HOST_FLAGS:
        pytest.skip("the rule picks between the avx512 build's two bf16 paths: needs it and AVX512_BF16")
    if any(os.environ.get(f"KT_KERNEL_{v}_AVX512_BF16") == "1" for v in ("FORCE", "DISABLE")):
        pytest.skip("a variable overrides the rule in this run")
    vendor = next(
        line.split(":", 1)[1].strip()
        for line in open("/proc/cpuinfo").read().splitlines()
        if line.startswith("vendor_id")
    )
    paths = kt_kernel.cpu_info()["kernels"]
    if vendor == "GenuineIntel":
        assert paths["bf16_path"].startswith("avx512f (bf16->fp32, fma"), paths["bf16_path"]
        assert "fp32 fma" in paths["fp8_path"], paths["fp8_path"]
    else:
        assert paths["bf16_path"] == "avx512_bf16 (vdpbf16ps)", paths["bf16_path"]
        assert "vdpbf16ps" in paths["fp8_path"], paths["fp8_path"]


# (experts, top_k, hidden, intermediate, tokens): odd sizes that are not multiples of the
# kernel blocks (16-row groups, 64-row tasks, 6/4/2-row register tiles), odd hidden sizes too.
SHAPES = [
    (8, 2, 64, 32, 1),
    (8, 2, 256, 128, 8),
    (16, 4, 200, 100, 37),
    (6, 3, 33, 17, 5),
    (4, 4, 48, 1, 3),
    (32, 8, 128, 80, 64),
    (12, 6, 96, 200, 301),
]


@pytest.mark.parametrize("experts,top_k,hidden,inter,tokens", SHAPES)
def test_forward_matches_reference(experts, top_k, hidden, inter, tokens):
    p = make_problem(experts, top_k, hidden, inter, tokens, seed=experts * 7 + tokens)
    out = make_wrapper(p).forward(p.hidden, p.ids, p.weights)
    assert out.shape == (tokens, hidden) and out.dtype == torch.bfloat16
    assert_close_to_reference(out, reference_forward(p))


def test_hot_expert_takes_every_token():
    p = make_problem(experts=10, top_k=3, hidden=160, inter=72, tokens=600, seed=3)
    p.ids[:, 0] = 4  # expert 4 in every token's top-k; the other picks must differ from it
    p.ids[:, 1:] = torch.where(p.ids[:, 1:] == 4, torch.full_like(p.ids[:, 1:], 9), p.ids[:, 1:])
    p.ids[:, 1] = torch.where(p.ids[:, 1] == p.ids[:, 2], torch.full_like(p.ids[:, 1], 0), p.ids[:, 1])
    p.ids[:, 2] = torch.where(p.ids[:, 1] == p.ids[:, 2], torch.full_like(p.ids[:, 2], 1), p.ids[:, 2])
    out = make_wrapper(p).forward(p.hidden, p.ids, p.weights)
    assert_close_to_reference(out, reference_forward(p))


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 129, 512])
def test_token_counts(tokens):
    p = make_problem(experts=16, top_k=4, hidden=128, inter=96, tokens=tokens, seed=tokens)
    assert_close_to_reference(make_wrapper(p).forward(p.hidden, p.ids, p.weights), reference_forward(p))


def test_gpu_experts_are_skipped():
    p = make_problem(experts=16, top_k=4, hidden=128, inter=64, tokens=40, seed=5)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[[0, 3, 7, 8]] = True
    out = make_wrapper(p, gpu_experts_mask=mask).forward(p.hidden, p.ids, p.weights)
    ref = reference_forward(p, skip=mask)
    assert_close_to_reference(out, ref)
    full = reference_forward(p)
    assert (ref - full).abs().max() > 0.1  # the masked experts really mattered


def test_minus_one_ids_contribute_nothing():
    p = make_problem(experts=8, top_k=4, hidden=64, inter=48, tokens=20, seed=6)
    p.ids[::2, 1] = -1
    p.ids[5, :] = -1  # a token with no expert at all -> zeros
    out = make_wrapper(p).forward(p.hidden, p.ids, p.weights)
    assert_close_to_reference(out, reference_forward(p))
    assert torch.all(out[5] == 0)


def test_physical_to_logical_map():
    p = make_problem(experts=8, top_k=2, hidden=64, inter=32, tokens=16, seed=8)
    slot_map = torch.tensor([3, 0, 1, 2, 7, 6, 5, 4])
    out = make_wrapper(p, slot_map=slot_map).forward(p.hidden, p.ids, p.weights)
    assert_close_to_reference(out, reference_forward(p, slot_map=slot_map))


def test_fewer_source_experts_than_slots():
    """Replicated experts: 8 physical slots filled from 5 logical experts."""
    p = make_problem(experts=8, top_k=2, hidden=64, inter=32, tokens=16, seed=9)
    slot_map = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    p5 = make_problem(experts=5, top_k=2, hidden=64, inter=32, tokens=16, seed=9)
    p.gate, p.up, p.down = p5.gate, p5.up, p5.down
    out = make_wrapper(p, slot_map=slot_map).forward(p.hidden, p.ids, p.weights)
    assert_close_to_reference(out, reference_forward(p, slot_map=slot_map))


def test_async_equals_sync_and_threads_agree():
    p = make_problem(experts=16, top_k=4, hidden=192, inter=112, tokens=33, seed=10)
    two = make_wrapper(p, threads=2)
    synced = two.forward(p.hidden, p.ids, p.weights)
    two.submit_forward(p.hidden, p.ids, p.weights)
    submitted = two.sync_forward(p.hidden)
    one = make_wrapper(p, threads=1).forward(p.hidden, p.ids, p.weights)
    three = make_wrapper(p, threads=3).forward(p.hidden, p.ids, p.weights)
    six = make_wrapper(p, threads=6).forward(p.hidden, p.ids, p.weights)  # pools over 4: 64-row tasks
    # Every output element is computed by exactly one task in a fixed order: bitwise equal.
    assert torch.equal(synced, submitted)
    assert torch.equal(synced, one)
    assert torch.equal(synced, three)
    assert torch.equal(synced, six)


def test_repeated_calls_with_fresh_routing():
    p = make_problem(experts=16, top_k=4, hidden=128, inter=64, tokens=9, seed=11)
    moe = make_wrapper(p)
    g = torch.Generator().manual_seed(1)
    for tokens in (9, 1, 300, 4):
        p.hidden = torch.randn(tokens, 128, generator=g).to(torch.bfloat16)
        p.ids, p.weights = random_routing(tokens, 16, 4, g)
        assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))


def test_fp16_and_fp32_weights_are_rounded_like_bf16():
    p = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=6, seed=12)
    ref = make_wrapper(p).forward(p.hidden, p.ids, p.weights)
    for dtype in (torch.float32, torch.float16):
        q = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=6, seed=12)
        q.gate, q.up, q.down = (w.to(dtype) for w in (p.gate, p.up, p.down))
        out = make_wrapper(q).forward(q.hidden, q.ids, q.weights)
        assert_close_to_reference(out, reference_forward(q))
        if dtype == torch.float32:
            assert torch.equal(out, ref)


def test_weights_are_copied_at_load():
    p = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=6, seed=13)
    gate, up, down = (w.to(torch.bfloat16) for w in (p.gate, p.up, p.down))
    moe = make_wrapper(p)
    before = moe.forward(p.hidden, p.ids, p.weights)
    for w in (gate, up, down, p.gate, p.up, p.down):
        w.zero_()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), before)


def test_output_is_a_new_tensor_and_input_untouched():
    """Decode calls allocate the next call's output ahead; each call still returns its own tensor,
    which later calls (of the same or another token count) leave alone."""
    p = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=6, seed=14)
    x = p.hidden.clone()
    moe = make_wrapper(p)
    a = moe.forward(p.hidden, p.ids, p.weights)
    kept = a.clone()
    b = moe.forward(p.hidden * 2, p.ids, p.weights)
    c = moe.forward(p.hidden[:3], p.ids[:3], p.weights[:3])
    d = moe.forward(p.hidden * 3, p.ids, p.weights)
    pointers = {t.data_ptr() for t in (a, b, c, d)}
    assert len(pointers) == 4 and p.hidden.data_ptr() not in pointers
    assert torch.equal(a, kept) and not torch.equal(b, a) and torch.equal(c, a[:3])
    assert torch.equal(p.hidden, x)


def test_non_contiguous_and_int32_inputs():
    p = make_problem(experts=8, top_k=2, hidden=64, inter=32, tokens=10, seed=15)
    moe = make_wrapper(p)
    ref = moe.forward(p.hidden, p.ids, p.weights)
    wide = torch.zeros(10, 128, dtype=torch.bfloat16)
    wide[:, ::2] = p.hidden
    out = moe.forward(wide[:, ::2], p.ids.to(torch.int32), p.weights.double())
    assert torch.equal(out, ref)


def test_zero_tokens_returns_empty():
    p = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=0, seed=16)
    moe = make_wrapper(p)
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    moe.submit_forward(p.hidden, p.ids, p.weights)
    assert moe.sync_forward().shape == (0, 64)


def test_clear_buffer_cache_keeps_results():
    p = make_problem(experts=8, top_k=2, hidden=64, inter=32, tokens=12, seed=17)
    moe = make_wrapper(p)
    before = moe.forward(p.hidden, p.ids, p.weights)
    KTMoEWrapper.set_capture_batch_sizes([1, 2, 4])
    assert KTMoEWrapper.get_capture_batch_sizes() == [1, 2, 4]
    KTMoEWrapper.clear_buffer_cache()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), before)


def test_tiny_calls_done_inline_match_the_pool():
    """A call of a few multiply-adds runs on the calling thread, a large one on the pool; each
    token's result depends only on its own row and experts, so the two must agree bit for bit."""
    p = make_problem(experts=8, top_k=2, hidden=64, inter=32, tokens=300, seed=18)
    moe = make_wrapper(p)
    pooled = moe.forward(p.hidden, p.ids, p.weights)  # 600 rows x 3 x 64 x 32 multiply-adds
    inline = moe.forward(p.hidden[:3], p.ids[:3], p.weights[:3])  # 6 rows: inline
    first3 = dataclasses.replace(p, hidden=p.hidden[:3], ids=p.ids[:3], weights=p.weights[:3])
    assert_close_to_reference(inline, reference_forward(first3))
    assert torch.equal(inline, pooled[:3])
