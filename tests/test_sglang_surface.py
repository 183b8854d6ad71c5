"""The surface SGLang's KT integration uses: its call sequence, live expert placement, global
GPU-expert masks and writing an expert back to caller buffers in the canonical layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks, quant  # SGLang's import line

from moe_reference import assert_close_to_reference, make_problem, moe_wrapper, reference_forward

E, K, H, I = 8, 2, 64, 64


def sglang_wrapper(layer_idx: int, mask: torch.Tensor | None, method: str = "BF16", **overrides):
    """A wrapper built with the keyword arguments SGLang passes."""
    args = dict(
        layer_idx=layer_idx, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
        gpu_experts_mask=mask, cpuinfer_threads=2, threadpool_count=1, numa_nodes=None, weight_path=None,
        chunked_prefill_size=512, method=method, max_deferred_experts_per_token=0,
    )  # fmt: skip
    args.update(overrides)
    return KTMoEWrapper(**args)


# ---- SGLang's call sequence ------------------------------------------------------------------
def test_sglang_call_sequence():
    problems = [make_problem(E, K, H, I, tokens=128, seed=layer) for layer in range(2)]
    freq = torch.tensor([[9, 1, 1, 1, 1, 1, 1, 8], [1, 1, 7, 1, 1, 1, 1, 1]], dtype=torch.float32)
    masks = generate_gpu_experts_masks(freq, num_gpu_experts=3)
    assert masks.nonzero().tolist() == [[0, 0], [0, 7], [1, 2]]
    wrappers = []
    for layer, p in enumerate(problems):
        wrapper = sglang_wrapper(layer, masks[layer])
        wrapper.load_weights_from_tensors(p.gate, p.up, p.down)
        wrappers.append(wrapper)
    KTMoEWrapper.set_capture_batch_sizes([1, 2, 4, 8])
    a, b = wrappers
    pa, pb = problems
    stream = 0
    for tokens in (128, 1):  # a prefill chunk run by the worker threads, then a decode step
        a.submit_forward(pa.hidden[:tokens], pa.ids[:tokens].to(torch.int32), pa.weights[:tokens], stream)
        b.submit_forward(pb.hidden[:tokens], pb.ids[:tokens].to(torch.int32), pb.weights[:tokens], stream)
        out_a = a.sync_forward(pa.hidden[:tokens], stream)
        out_b = b.sync_forward(pb.hidden[:tokens], stream)
        for out, p, mask in ((out_a, pa, masks[0]), (out_b, pb, masks[1])):
            head = dataclasses.replace(
                p, hidden=p.hidden[:tokens], ids=p.ids[:tokens], weights=p.weights[:tokens]
            )
            assert_close_to_reference(out, reference_forward(head, skip=mask))


def test_method_is_kept_as_given():
    moe = sglang_wrapper(0, None, method="AMXINT4")
    assert moe.method == "AMXINT4" and moe.weight_format == "INT4"
    assert "method='AMXINT4'" in repr(moe)
    assert sglang_wrapper(0, None, method="amxint8").method == "amxint8"


def test_upstream_attributes():
    moe = sglang_wrapper(0, None, weight_path="/models/x", chunked_prefill_size=256, cpu_save=True)
    assert moe.num_gpu_experts == 0 and moe.max_deferred_experts_per_token == 0
    assert moe.weight_path == "/models/x" and moe.chunked_prefill_size == 256 and moe.cpu_save is True
    assert sglang_wrapper(0, None, max_deferred_experts_per_token=None).max_deferred_experts_per_token == 0
    assert moe.gpu_experts_mask.dtype == torch.bool and moe.gpu_experts_mask.shape == (E,)
    assert moe.gpu_experts_mask.device.type == "cpu"


def test_num_gpu_experts_form():
    moe = sglang_wrapper(0, None, num_gpu_experts=3)
    assert moe.gpu_experts_mask.tolist() == [True] * 3 + [False] * (E - 3)  # upstream: experts 0..n-1
    assert moe.num_gpu_experts == 3
    moe = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H,
                       moe_intermediate_size=I, num_gpu_experts=2, cpuinfer_threads=2, threadpool_count=1,
                       weight_path=None, chunked_prefill_size=512, method="BF16")  # fmt: skip
    assert moe.num_gpu_experts == 2
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 6]] = True
    agreeing = sglang_wrapper(0, mask, num_gpu_experts=2)
    assert agreeing.gpu_experts_mask.tolist() == mask.tolist()
    # Upstream's older positional signature: an int where gpu_experts_mask is.
    positional = KTMoEWrapper(0, E, K, H, I, 4, 2, 1, None, 512, method="BF16")
    assert positional.num_gpu_experts == 4 and positional.gpu_experts_mask[:4].all()


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        ({"num_gpu_experts": 2, "gpu_experts_mask": torch.ones(E, dtype=torch.bool)}, ValueError, "disagree"),
        ({"num_gpu_experts": E + 1}, ValueError, "num_gpu_experts \\(9\\) cannot exceed num_experts"),
        ({"num_gpu_experts": -1}, ValueError, "num_gpu_experts must be >= 0"),
        ({"num_gpu_experts": 1.0}, TypeError, "num_gpu_experts must be an int"),
        ({"gpu_experts_mask": 3, "num_gpu_experts": 2}, ValueError, "num_gpu_experts is given twice"),
        ({"mode": "sft"}, NotImplementedError, "SFT mode is not supported"),
        ({"mode": "training"}, ValueError, "mode must be 'inference'"),
        ({"max_deferred_experts_per_token": -1}, ValueError, "max_deferred_experts_per_token must be >= 0"),
        ({"cpuinfer_threads": None}, TypeError, "cpuinfer_threads is required"),
        ({"lora_rank": 16}, TypeError, "lora_rank"),
    ],
)
def test_bad_construction(overrides, error, match):
    with pytest.raises(error, match=match):
        sglang_wrapper(0, None, **overrides)


def test_mode_inference_is_accepted():
    assert sglang_wrapper(0, None, mode="inference").method == "BF16"


# ---- live expert placement -------------------------------------------------------------------
@pytest.mark.parametrize("pools", [1, 2])
def test_mask_update_takes_effect_at_the_next_submit(pools):
    p = make_problem(E, K, H, I, tokens=64, seed=11)
    moe = sglang_wrapper(0, None, threadpool_count=pools)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    ids = p.ids.to(torch.int32)
    everything = moe.forward(p.hidden, ids, p.weights)
    assert_close_to_reference(everything, reference_forward(p))

    hot = int(p.ids.flatten().mode().values)
    moe.gpu_experts_mask.copy_(torch.nn.functional.one_hot(torch.tensor(hot), E).bool())  # SGLang's update
    assert moe.num_gpu_experts == 1
    without = moe.forward(p.hidden, ids, p.weights)
    mask = moe.gpu_experts_mask.clone()
    assert_close_to_reference(without, reference_forward(p, skip=mask))
    assert (without.double() - everything.double()).abs().max() > 0.05  # the expert mattered
    fresh = sglang_wrapper(0, mask, threadpool_count=pools)  # as if the mask had been there from the start
    fresh.load_weights_from_tensors(p.gate, p.up, p.down)
    assert torch.equal(without, fresh.forward(p.hidden, ids, p.weights))

    moe.gpu_experts_mask.zero_()  # the expert comes back to the CPU: its weights were packed all along
    assert moe.num_gpu_experts == 0
    assert torch.equal(moe.forward(p.hidden, ids, p.weights), everything)


def test_mask_assignment_and_in_flight_forward():
    p = make_problem(E, K, H, I, tokens=128, seed=12)
    moe = sglang_wrapper(0, None)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    everything = moe.forward(p.hidden, p.ids, p.weights)
    mask_tensor = moe.gpu_experts_mask
    moe.submit_forward(p.hidden, p.ids, p.weights)
    moe.gpu_experts_mask = [True, False, False, True, False, False, False, False]  # while in flight
    assert moe.gpu_experts_mask is mask_tensor  # assigned in place: the engines read this memory
    assert torch.equal(moe.sync_forward(p.hidden), everything)  # the forward in flight keeps its mask
    assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p, skip=mask_tensor))
    with pytest.raises(ValueError, match="gpu_experts_mask must have shape"):
        moe.gpu_experts_mask = torch.zeros(E + 1, dtype=torch.bool)
    with pytest.raises(TypeError, match="gpu_experts_mask must be a bool tensor"):
        moe.gpu_experts_mask = torch.zeros(E)
    with pytest.raises(AttributeError):
        moe.num_gpu_experts = 3  # derived from the mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mask_update_from_a_cuda_mask():
    moe = sglang_wrapper(0, None)
    moe.gpu_experts_mask.copy_(torch.ones(E, dtype=torch.bool, device="cuda"))
    assert moe.num_gpu_experts == E and moe.gpu_experts_mask.device.type == "cpu"


# ---- generate_gpu_experts_masks --------------------------------------------------------------
def test_generate_gpu_experts_masks_by_hand():
    freq = torch.tensor([[0.1, 0.5, 0.3, 0.8], [0.2, 0.4, 0.9, 0.1]])
    # The 3 largest over both layers: 0.9 (layer 1, expert 2), 0.8 (0, 3), 0.5 (0, 1).
    expected = torch.tensor([[False, True, False, True], [False, False, True, False]])
    assert torch.equal(generate_gpu_experts_masks(freq, 3), expected)
    assert not generate_gpu_experts_masks(freq, 0).any()
    assert generate_gpu_experts_masks(freq, 8).all()
    # Ties go to the lower layer, then the lower expert.
    counts = torch.tensor([[1, 2, 2], [2, 0, 1]])
    assert generate_gpu_experts_masks(counts, 2).nonzero().tolist() == [[0, 1], [0, 2]]
    assert generate_gpu_experts_masks(counts, 3).nonzero().tolist() == [[0, 1], [0, 2], [1, 0]]
    all_equal = generate_gpu_experts_masks(torch.zeros(3, 1000), 4)
    assert all_equal.nonzero().tolist() == [[0, i] for i in range(4)]
    mask = generate_gpu_experts_masks(torch.ones(2, 3, dtype=torch.bool), 1)
    assert mask.dtype == torch.bool and mask.device.type == "cpu" and mask.shape == (2, 3)


@pytest.mark.parametrize(
    "freq,count,error,match",
    [
        ([[1.0, 2.0]], 1, TypeError, "activation_freq must be a torch.Tensor"),
        (torch.ones(4), 1, ValueError, "activation_freq must have shape \\[num_layers, num_experts\\]"),
        (torch.ones(2, 2, dtype=torch.complex64), 1, TypeError, "activation_freq must be real"),
        (torch.tensor([[1.0, float("nan")]]), 1, ValueError, "activation_freq holds NaN"),
        (torch.ones(2, 2), 5, ValueError, "num_gpu_experts must be in \\[0, 4\\]"),
        (torch.ones(2, 2), -1, ValueError, "num_gpu_experts must be in"),
        (torch.ones(2, 2), 1.0, TypeError, "num_gpu_experts must be an int"),
        (torch.ones(2, 2), True, TypeError, "num_gpu_experts must be an int"),
    ],
)
def test_generate_gpu_experts_masks_bad_input(freq, count, error, match):
    with pytest.raises(error, match=match):
        generate_gpu_experts_masks(freq, count)


# ---- writing an expert back ------------------------------------------------------------------
# (hidden, intermediate) per method: subpool cuts and tp parts fall apart where the format allows.
WRITE_SHAPES = {"BF16": (64, 80), "INT8": (64, 80), "INT4": (64, 256), "MXFP4": (64, 192), "FP8": (128, 256)}


def expected_buffers(method: str, gate, up, down, tp: int, inter: int) -> list[dict[str, torch.Tensor]]:
    """Per tp part: one expert's canonical w13 / w13 scale / w2 / w2 scale, from its (values,
    scales) pairs gate, up and down."""
    part = inter // tp
    parts = []
    for r in range(tp):
        a, b = r * part, (r + 1) * part
        per_byte = 2 if method in ("INT4", "RAWINT4", "MXFP4") else 1
        buffers = {
            "w13": torch.cat([gate[0][a:b], up[0][a:b]]),
            "w2": down[0][:, a // per_byte : b // per_byte],
        }
        if method != "BF16":
            buffers["w13_scale"] = torch.cat([gate[1][a:b], up[1][a:b]])
            if down[1].dim() == 1:  # one scale per down row, whole in every part
                buffers["w2_scale"] = down[1]
            else:
                block = inter // down[1].shape[1]
                buffers["w2_scale"] = down[1][:, a // block : b // block]
        parts.append({name: upstream_layout(method, name, t).contiguous() for name, t in buffers.items()})
    return parts


def upstream_layout(method: str, name: str, canonical: torch.Tensor) -> torch.Tensor:
    """What upstream kt-kernel writes for `method` where we have `canonical` bytes: MXFP4 scales as
    bf16 bits e << 7 (fp4-moe.hpp, its loader's E8M0 conversion); RAWINT4 nibbles offset by 8 and
    bf16 scales (k2-moe.hpp, rawint4-moe.hpp); FP8 scales one per 128 x 128 block (fp8-moe.hpp)."""
    scale = name.endswith("scale")
    if method == "MXFP4" and scale:
        return (canonical.to(torch.int16) << 7).view(torch.bfloat16)
    if method == "RAWINT4":
        return canonical.to(torch.bfloat16) if scale else canonical ^ 0x88
    if method == "FP8" and scale:
        return canonical[::128]
    return canonical


def write_back(moe: KTMoEWrapper, expert: int, tp: int, like: list[dict[str, torch.Tensor]]) -> list[dict]:
    """Buffers shaped like `like`, filled with garbage, then written by the wrapper."""
    buffers = [{name: torch.full_like(t.view(torch.uint8), 0xA5).view(t.dtype) for name, t in part.items()}
               for part in like]  # fmt: skip
    ptrs = {name: [part[name].data_ptr() for part in buffers] if name in buffers[0] else None
            for name in ("w13", "w13_scale", "w2", "w2_scale")}  # fmt: skip
    moe.submit_write_weight_scale_to_buffer(
        tp, expert, ptrs["w13"], ptrs["w13_scale"], ptrs["w2"], ptrs["w2_scale"]
    )
    moe.sync_write_weight_scale_to_buffer()
    return buffers


def assert_same_bytes(got: list[dict], expected: list[dict]) -> None:
    for r, (g, e) in enumerate(zip(got, expected, strict=True)):
        for name in e:
            assert torch.equal(g[name].view(torch.uint8), e[name].view(torch.uint8)), f"part {r} {name}"


@pytest.mark.parametrize("method", ["BF16", "INT8", "INT4", "MXFP4"])
@pytest.mark.parametrize("pools", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_write_back_is_bit_exact(method, pools, tp):
    hidden, inter = WRITE_SHAPES[method]
    p = make_problem(E, K, hidden, inter, tokens=1, seed=20)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[3] = True  # a GPU expert is packed too, and written back like any other
    moe = moe_wrapper(E, K, hidden, inter, method=method, threadpool_count=pools, gpu_experts_mask=mask)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    for expert in (0, 3, E - 1):
        # What load_weights_from_tensors made of the float weights: quant.quantize's output.
        gate, up, down = (quant.quantize(method, w[expert]) for w in (p.gate, p.up, p.down))
        expected = expected_buffers(method, gate, up, down, tp, inter)
        assert_same_bytes(write_back(moe, expert, tp, expected), expected)


@pytest.mark.parametrize(
    "method,inter,tp,down_group",
    [
        ("MXFP4", 192, 3, None),
        ("INT4", 384, 2, 64),
        ("INT4", 384, 6, 32),
        ("BF16", 80, 5, None),
        ("GGUF", 192, 3, 16),  # (scale, min) pairs, groups of 16 in down
    ],
)
def test_write_back_of_given_canonical_weights(method, inter, tp, down_group):
    """Weights given with scales come back as given, also where tp parts straddle subpool cuts."""
    hidden = 64
    p = make_problem(E, K, hidden, inter, tokens=1, seed=21)
    group = {} if down_group is None else {"group_size": down_group}
    gate, up = (quant.quantize(method, w) for w in (p.gate, p.up))
    down = quant.quantize(method, p.down, **group)
    moe = moe_wrapper(E, K, hidden, inter, method=method, threadpool_count=2)
    if method == "BF16":
        moe.load_weights_from_tensors(gate[0], up[0], down[0])
    else:
        scales = {"gate_scale": gate[1], "up_scale": up[1], "down_scale": down[1]}
        moe.load_weights_from_tensors(gate[0], up[0], down[0], **scales)
    for expert in range(E):
        one = [tuple(t[expert] if t is not None else None for t in w) for w in (gate, up, down)]
        expected = expected_buffers(method, *one, tp, inter)
        assert_same_bytes(write_back(moe, expert, tp, expected), expected)


def test_rawint4_writes_nibbles_offset_by_8_and_bf16_scales():
    hidden, inter, tp = 64, 256, 2
    p = make_problem(E, K, hidden, inter, tokens=1, seed=23)
    # Kimi-K2's checkpoints hold bf16 scales: given as such, they come back exact.
    gate, up, down = (
        (v, s.to(torch.bfloat16)) for v, s in (quant.quantize("INT4", w, 32) for w in (p.gate, p.up, p.down))
    )
    moe = moe_wrapper(E, K, hidden, inter, method="RAWINT4", threadpool_count=2)
    moe.load_weights_from_tensors(
        gate[0], up[0], down[0], gate_scale=gate[1], up_scale=up[1], down_scale=down[1]
    )
    for expert in (0, 5):
        one = [tuple(t[expert] for t in w) for w in (gate, up, down)]
        expected = expected_buffers("RAWINT4", *one, tp, inter)
        assert_same_bytes(write_back(moe, expert, tp, expected), expected)


def fp8_block_weights(hidden: int, inter: int, seed: int):
    """FP8 codes with DeepSeek's block scales [E, N/128, K/128] for gate, up, down."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        codes = (torch.randn(E, n, k, generator=g) * 50).to(torch.float8_e4m3fn).view(torch.uint8)
        out.append((codes, torch.rand(E, n // 128, k // 128, generator=g) + 0.01))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_writes_one_scale_per_block_and_per_channel_one_per_row(tp):
    hidden, inter = 256, 256
    (gv, gs), (uv, us), (dv, ds) = fp8_block_weights(hidden, inter, 24)
    moe = moe_wrapper(E, K, hidden, inter, method="FP8", threadpool_count=2)
    moe.load_weights_from_tensors(gv, uv, dv, gate_scale=gs, up_scale=us, down_scale=ds)
    rows = [(v, s.repeat_interleave(128, dim=1)) for v, s in ((gv, gs), (uv, us), (dv, ds))]  # canonical
    for expert in (1, 6):
        one = [tuple(t[expert] for t in w) for w in rows]
        expected = expected_buffers("FP8", *one, tp, inter)
        got = write_back(moe, expert, tp, expected)
        assert_same_bytes(got, expected)
        assert got[0]["w13_scale"].shape == (2 * inter // tp // 128, hidden // 128)  # blocks, gate then up
    channel = [
        (v, s[..., :1].repeat_interleave(128, dim=1)[..., 0]) for v, s in ((gv, gs), (uv, us), (dv, ds))
    ]
    moe = moe_wrapper(E, K, hidden, inter, method="FP8_PERCHANNEL")
    moe.load_weights_from_tensors(
        *(v for v, _ in channel),
        **dict(zip(("gate_scale", "up_scale", "down_scale"), (s for _, s in channel), strict=True)),
    )
    one = [tuple(t[2] for t in w) for w in channel]
    expected = expected_buffers("FP8_PERCHANNEL", *one, tp, inter)
    assert_same_bytes(write_back(moe, 2, tp, expected), expected)


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
def test_fp8_scales_upstream_cannot_hold_are_refused(method):
    hidden, inter = 256, 256
    p = make_problem(E, K, hidden, inter, tokens=1, seed=25)
    moe = moe_wrapper(E, K, hidden, inter, method=method)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)  # quantized here: one scale per row and 128 inputs
    buffers = [torch.empty(2 * inter * hidden, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(ValueError, match="upstream's FP8"):
        moe.submit_write_weight_scale_to_buffer(1, 0, *([b.data_ptr()] for b in buffers))


def test_write_back_reads_the_physical_slot():
    p = make_problem(6, K, H, I, tokens=1, seed=22)
    slot_map = torch.tensor([5, 4, 3, 2, 1, 0, 0, 1])
    moe = moe_wrapper(E, K, H, I)
    moe.load_weights_from_tensors(p.gate, p.up, p.down, physical_to_logical_map_cpu=slot_map)
    for slot in (0, 6):
        source = int(slot_map[slot])
        gate, up, down = ((w[source].to(torch.bfloat16), None) for w in (p.gate, p.up, p.down))
        expected = expected_buffers("BF16", gate, up, down, 1, I)
        assert_same_bytes(write_back(moe, slot, 1, expected), expected)


@pytest.fixture
def loaded_int4() -> KTMoEWrapper:
    p = make_problem(E, K, H, 256, tokens=1, seed=23)
    moe = moe_wrapper(E, K, H, 256, method="AMXINT4")
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    return moe


@pytest.mark.parametrize(
    "args,error,match",
    [
        ({"gpu_tp_count": 0}, ValueError, "gpu_tp_count must be >= 1"),
        ({"gpu_tp_count": 3}, ValueError, "gpu_tp_count=3 must split moe_intermediate_size=256 evenly"),
        ({"gpu_tp_count": 4}, ValueError, "gpu_tp_count=4 .* whole blocks of 128"),  # INT4 down groups of 128
        ({"gpu_tp_count": 1.0}, TypeError, "gpu_tp_count must be an int"),
        ({"expert_id": E}, ValueError, "expert_id must be in \\[0, 8\\)"),
        ({"expert_id": -1}, ValueError, "expert_id must be >= 0"),
        ({"w13_weight_ptrs": [1, 2]}, ValueError, "w13_weight_ptrs must hold gpu_tp_count = 1 addresses"),
        ({"w2_weight_ptrs": 12345}, TypeError, "w2_weight_ptrs must be a list"),
        ({"w13_scale_ptrs": None}, TypeError, "w13_scale_ptrs must be a list"),
        ({"w2_scale_ptrs": []}, ValueError, "w2_scale_ptrs must hold gpu_tp_count = 1"),
        ({"w2_scale_ptrs": [0]}, ValueError, "w2_scale_ptrs\\[0\\] = 0 is not a valid address"),
        ({"w13_weight_ptrs": [True]}, TypeError, "w13_weight_ptrs\\[0\\] must be an int address"),
    ],
)
def test_write_back_bad_input(loaded_int4, args, error, match):
    buffer = torch.empty(1 << 20, dtype=torch.uint8)  # large enough for any part written here
    call = dict(
        gpu_tp_count=1, expert_id=0, w13_weight_ptrs=[buffer.data_ptr()], w13_scale_ptrs=[buffer.data_ptr()],
        w2_weight_ptrs=[buffer.data_ptr()], w2_scale_ptrs=[buffer.data_ptr()],
    )  # fmt: skip
    call.update(args)
    with pytest.raises(error, match=match):
        loaded_int4.submit_write_weight_scale_to_buffer(**call)


def test_write_back_needs_loaded_idle_weights():
    p = make_problem(E, K, H, I, tokens=128, seed=24)
    moe = moe_wrapper(E, K, H, I)
    buffer = torch.empty(1 << 16, dtype=torch.uint8)
    ptrs = [buffer.data_ptr()]
    with pytest.raises(RuntimeError, match="weights are not loaded"):
        moe.submit_write_weight_scale_to_buffer(1, 0, ptrs, None, ptrs, None)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    moe.submit_write_weight_scale_to_buffer(1, 0, ptrs, [], ptrs, [])  # BF16: empty scale lists
    moe.submit_forward(p.hidden, p.ids, p.weights)
    with pytest.raises(RuntimeError, match="while a forward is in flight"):
        moe.submit_write_weight_scale_to_buffer(1, 0, ptrs, None, ptrs, None)
    moe.sync_forward(p.hidden)
    moe.close()
    with pytest.raises(RuntimeError, match="closed"):
        moe.submit_write_weight_scale_to_buffer(1, 0, ptrs, None, ptrs, None)
