"""Deferred experts and live masks under misuse: no crash, no silent wrong result, nothing lost, and
every wrapper usable afterwards. (CI's sanitizer pass runs these under AddressSanitizer.)"""

from __future__ import annotations

import threading

import pytest
import torch
from test_deferred import LAYERS, E, H, I, K, T, assert_same_total, run_pass, stack

from kt_kernel import KTMoEWrapper

from moe_reference import make_problem, moe_wrapper


@pytest.fixture(autouse=True)
def no_pending_deferred():
    yield
    KTMoEWrapper.flush_deferred()


def test_two_stacks_on_two_threads_never_see_each_others_deferred_experts():
    plain, problems = stack([0] * LAYERS)
    reference = run_pass(plain, problems)
    stacks = [stack([2, 1, 2, 0])[0] for _ in range(2)]
    failures: list[BaseException] = []

    def drive(layers) -> None:
        try:
            for _ in range(40):
                assert_same_total(run_pass(layers, problems), reference)
                assert KTMoEWrapper.flush_deferred() is None
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=drive, args=(layers,)) for layers in stacks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]


def layer_1_takes_layer_0s_deferred_experts():
    """A deferring stack, its reference outputs, and layer 0's output with layer 1 submitted (it
    takes layer 0's deferred experts) but not synced."""
    plain, problems = stack([0] * LAYERS)
    reference = run_pass(plain, problems)
    layers, _ = stack([2, 2, 2, 0])
    p0, p1 = problems[0], problems[1]
    layers[0].submit_forward(p0.hidden, p0.ids, p0.weights)
    out0 = layers[0].sync_forward()
    layers[1].submit_forward(p1.hidden, p1.ids, p1.weights)
    return layers, problems, reference, out0


def test_resubmitting_a_layer_before_the_layer_that_adds_its_deferred_experts_syncs_is_refused():
    layers, problems, reference, out0 = layer_1_takes_layer_0s_deferred_experts()
    p0 = problems[0]
    with pytest.raises(RuntimeError, match="being added by layer 1's call, which has not been synced"):
        layers[0].submit_forward(p0.hidden, p0.ids, p0.weights)
    outputs = [out0, layers[1].sync_forward()] + run_pass(layers[2:], problems[2:])
    assert_same_total(outputs, reference)  # nothing lost
    assert_same_total(run_pass(layers, problems), reference)  # and every layer goes on


def test_a_layer_closed_after_a_later_call_took_its_deferred_experts_still_gives_them():
    layers, problems, reference, out0 = layer_1_takes_layer_0s_deferred_experts()
    layers[0].close()
    outputs = [out0, layers[1].sync_forward()] + run_pass(layers[2:], problems[2:])
    assert_same_total(outputs, reference)


@pytest.mark.parametrize("bad", [-2, E, 2**40])
def test_a_bad_expert_id_with_deferral_is_refused_before_anything_runs(bad):
    plain, problems = stack([0] * LAYERS)
    reference = run_pass(plain, problems)
    layers, _ = stack([2, 2, 2, 0])
    outputs = run_pass(layers[:1], problems[:1])  # layer 0's deferred experts pending
    p1 = problems[1]
    ids = p1.ids.clone()
    ids[1, K - 1] = bad  # the lowest-scored slot: it would be deferred
    with pytest.raises(ValueError, match=rf"topk_ids\[1, {K - 1}\] = {bad} is outside \[-1, {E}\)"):
        layers[1].submit_forward(p1.hidden, ids, p1.weights)
    outputs += run_pass(layers[1:], problems[1:])  # layer 0's deferred experts are still added
    assert_same_total(outputs, reference)


def test_replacing_the_masks_storage_takes_effect_or_is_refused():
    p = make_problem(E, K, H, I, T, seed=3)
    moe = moe_wrapper(E, K, H, I)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    call = (p.hidden, p.ids, p.weights)
    used = p.ids[0, 0].item()
    masked = torch.zeros(E, dtype=torch.bool)
    masked[used] = True
    reference = moe_wrapper(E, K, H, I, gpu_experts_mask=masked)
    reference.load_weights_from_tensors(p.gate, p.up, p.down)
    expected, unmasked = reference.forward(*call), moe.forward(*call)
    assert not torch.equal(expected, unmasked)
    for replace in (
        lambda m: setattr(m, "data", masked.clone()),
        lambda m: m.set_(masked.clone()),
        lambda m: (m.copy_(masked), m.share_memory_()),
    ):
        moe.gpu_experts_mask.zero_()
        assert torch.equal(moe.forward(*call), unmasked)
        replace(moe.gpu_experts_mask)
        assert torch.equal(moe.forward(*call), expected)
    moe.gpu_experts_mask.data = torch.zeros(E, dtype=torch.float32)
    with pytest.raises(TypeError, match="gpu_experts_mask must stay a bool tensor"):
        moe.forward(*call)
    moe.gpu_experts_mask.data = torch.zeros(E + 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="gpu_experts_mask must have shape"):
        moe.forward(*call)
    moe.gpu_experts_mask = masked  # assigning a mask is always fine
    moe.gpu_experts_mask.data = masked.clone()
    assert torch.equal(moe.forward(*call), expected)


@pytest.mark.parametrize("address", [1, 64, 4096])
def test_write_back_refuses_addresses_below_the_lowest_mappable_page(address):
    p = make_problem(E, K, H, I, 1)
    moe = moe_wrapper(E, K, H, I)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    buffer = torch.empty(2 * I * H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="is not a valid address"):
        moe.submit_write_weight_scale_to_buffer(1, 0, [address], None, [buffer.data_ptr()], None)
    with pytest.raises(ValueError, match="gpu_tp_count = 1 addresses"):
        moe.submit_write_weight_scale_to_buffer(
            1, 0, [buffer.data_ptr()] * 2, None, [buffer.data_ptr()], None
        )


@pytest.mark.parametrize(
    "mask,error,match",
    [
        (torch.zeros(E, dtype=torch.bool, device="meta"), ValueError, "meta tensor"),
        (torch.zeros(E, dtype=torch.bool).to_sparse(), TypeError, "dense tensor"),
        ({1: 2}, TypeError, "got dict"),
        ((x for x in range(E)), TypeError, "got generator"),
        (torch.zeros(E).to(torch.float8_e4m3fn), TypeError, "must be a bool tensor"),
    ],
    ids=["meta", "sparse", "dict", "generator", "float8"],
)
def test_masks_of_the_wrong_kind_are_errors_naming_the_argument(mask, error, match):
    moe = moe_wrapper(E, K, H, I)
    with pytest.raises(error, match=match):
        moe.gpu_experts_mask = mask
    with pytest.raises(error, match=match):
        moe_wrapper(E, K, H, I, gpu_experts_mask=mask)


@pytest.mark.parametrize(
    "freq,error,match",
    [
        (torch.zeros(2, E, device="meta"), ValueError, "meta tensor"),
        (torch.zeros(2, E).to_sparse(), TypeError, "dense tensor"),
        (torch.nested.nested_tensor([torch.zeros(E), torch.zeros(E)]), TypeError, "activation_freq .*nested"),
    ],
    ids=["meta", "sparse", "nested"],
)
def test_activation_frequencies_of_the_wrong_kind_are_errors_naming_the_argument(freq, error, match):
    from kt_kernel import generate_gpu_experts_masks

    with pytest.raises(error, match=match):
        generate_gpu_experts_masks(freq, 3)
    low_precision = torch.rand(2, E).to(torch.float8_e4m3fn)
    assert generate_gpu_experts_masks(low_precision, 3).sum() == 3


SIGINT_SCRIPT = """
import signal, sys, threading, time, torch
sys.path.insert(0, "tests")
from moe_reference import make_problem, moe_wrapper
from kt_kernel import KTMoEWrapper
p = make_problem(8, 4, 256, 256, 600, seed=1)  # a prefill-sized call: a few milliseconds
layers = [moe_wrapper(8, 4, 256, 256, layer_idx=0, max_deferred_experts_per_token=2),
          moe_wrapper(8, 4, 256, 256, layer_idx=1)]
for moe in layers:
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
call = (p.hidden, p.ids, p.weights)
expected = [moe.forward(*call) for moe in layers]
armed = [False]

def on_sigint(signum, frame):  # Ctrl-C, but only while the calls run (one at a time)
    if armed[0]:
        armed[0] = False
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_sigint)
main, stop = threading.get_ident(), threading.Event()

def interrupt():
    while not stop.wait(0.0037):
        signal.pthread_kill(main, signal.SIGINT)

sender = threading.Thread(target=interrupt)
sender.start()
interrupts, deadline = 0, time.monotonic() + 3
while time.monotonic() < deadline:
    try:
        armed[0] = True
        for moe in layers:
            moe.forward(*call)
        armed[0] = False
    except KeyboardInterrupt:
        interrupts += 1
stop.set()
sender.join()
KTMoEWrapper.flush_deferred()  # what an interrupted pass left pending
got = [moe.forward(*call) for moe in layers]
print(interrupts, all(torch.equal(a, b) for a, b in zip(got, expected)))
"""


def test_sigint_at_random_moments_of_forward_calls_never_crashes_or_wedges():
    from conftest import run_python

    result = run_python(SIGINT_SCRIPT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    interrupts, same = result.stdout.split()
    assert int(interrupts) > 10 and same == "True", result.stdout


def test_an_interrupt_the_moment_the_direct_submit_returns_leaves_no_call_behind(monkeypatch):
    """The window the random SIGINT test hit under ASan: the engines started, the wrapper not yet
    told. forward must still wait for that call, so that no later call frees its output under it."""
    from kt_kernel.direct_path import DirectForward

    p = make_problem(8, 4, 256, 256, 64, seed=3)
    moe = moe_wrapper(8, 4, 256, 256)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    expected = moe.forward(p.hidden, p.ids, p.weights)
    submit = DirectForward.submit

    def submit_then_interrupt(self, *args):
        submit(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(DirectForward, "submit", submit_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        moe.forward(p.hidden, p.ids, p.weights)
    monkeypatch.setattr(DirectForward, "submit", submit)
    assert not moe._direct.busy and moe._in_flight is None  # waited for and dropped
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), expected)
