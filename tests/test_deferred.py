"""Deferred experts (max_deferred_experts_per_token = d > 0), upstream's semantics: the K - d
highest-scored experts of each token run now; the rest run after, while the caller goes on, and
their output is added to the next call's output. Over a stack of layers nothing is lost."""

from __future__ import annotations

import pytest
import torch

from kt_kernel import KTMoEWrapper

from moe_reference import make_problem, moe_wrapper

# Two tokens: upstream protects an expert for every token once one token protects it, so with
# many tokens nearly nothing would be deferred.
E, K, H, I, T, LAYERS = 8, 4, 128, 64, 2, 4


@pytest.fixture(autouse=True)
def no_pending_deferred():
    yield
    KTMoEWrapper.flush_deferred()  # a failing test must not leave work for the next one


def stack(deferred: list[int], method: str = "BF16") -> tuple[list[KTMoEWrapper], list]:
    problems = [make_problem(E, K, H, I, T, seed=layer) for layer in range(LAYERS)]
    layers = []
    for layer, (p, d) in enumerate(zip(problems, deferred, strict=True)):
        moe = moe_wrapper(E, K, H, I, layer_idx=layer, method=method, max_deferred_experts_per_token=d)
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
        layers.append(moe)
    return layers, problems


def run_pass(layers, problems) -> list[torch.Tensor]:
    outputs = []
    for moe, p in zip(layers, problems, strict=True):
        moe.submit_forward(p.hidden, p.ids, p.weights)
        outputs.append(moe.sync_forward())
    return outputs


def assert_same_total(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    total, expected = sum(o.double() for o in outputs), sum(o.double() for o in reference)
    # Each output is rounded to bf16 once more with deferral (its own part, then the sum): a lost
    # expert would move the total by tens of percent.
    assert ((total - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("method", ["BF16", "INT4"])
def test_a_stack_with_deferral_sums_to_the_stack_without(method):
    plain_layers, problems = stack([0] * LAYERS, method)
    reference = run_pass(plain_layers, problems)
    layers, _ = stack([2, 2, 1, 0], method)  # the last layer defers nothing
    for _ in range(2):  # a second pass starts clean
        outputs = run_pass(layers, problems)
        assert KTMoEWrapper.flush_deferred() is None
        assert_same_total(outputs, reference)
        # Deferral moved work between layers: the first layer's output lacks its deferred experts.
        assert not torch.equal(outputs[0], reference[0])


def test_the_last_layers_deferred_experts_are_flushed():
    plain_layers, problems = stack([0] * LAYERS)
    reference = run_pass(plain_layers, problems)
    layers, _ = stack([2] * LAYERS)
    outputs = run_pass(layers, problems)
    flushed = KTMoEWrapper.flush_deferred()
    assert flushed is not None and flushed.shape == (T, H)
    assert_same_total([*outputs, flushed], reference)


def test_a_new_pass_with_deferred_experts_pending_is_refused():
    layers, problems = stack([2] * LAYERS)
    run_pass(layers, problems)
    with pytest.raises(RuntimeError, match="flush_deferred"):
        layers[0].submit_forward(problems[0].hidden, problems[0].ids, problems[0].weights)
    assert KTMoEWrapper.flush_deferred() is not None
    run_pass(layers, problems)  # fine after the flush


def test_sync_does_not_wait_for_the_deferred_experts():
    layers, problems = stack([2] * LAYERS)
    p = problems[0]
    layers[0].submit_forward(p.hidden, p.ids, p.weights)
    layers[0].sync_forward()
    assert layers[0]._deferred.out is not None  # still the next call's: not collected by this sync
    with pytest.raises(RuntimeError, match="deferred experts are in flight"):
        layers[0].load_weights_from_tensors(p.gate, p.up, p.down)


def test_select_deferred_experts_protects_an_expert_for_every_token():
    moe = moe_wrapper(6, 3, 64, 32)
    ids = torch.tensor([[0, 1, 2], [3, 0, 4], [5, 1, -1]])
    scores = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.7, 0.2, 0.0]])
    now, later = moe.select_deferred_experts(ids, scores, protected_k=1)
    # protected: 0 (token 0), 3 (token 1), 5 (token 2); expert 0 stays protected in token 1 too.
    assert now.tolist() == [[0, -1, -1], [3, 0, -1], [5, -1, -1]]
    assert later.tolist() == [[-1, 1, 2], [-1, -1, 4], [-1, 1, -1]]


def test_bad_deferral_counts():
    with pytest.raises(ValueError, match="must be less than num_experts_per_tok"):
        moe_wrapper(E, K, H, I, max_deferred_experts_per_token=K)
    with pytest.raises(ValueError, match="max_deferred_experts_per_token must be >= 0"):
        moe_wrapper(E, K, H, I, max_deferred_experts_per_token=-1)


def test_a_refused_call_leaves_the_deferred_experts_for_the_next_one():
    plain_layers, problems = stack([0] * LAYERS)
    reference = run_pass(plain_layers, problems)
    layers, _ = stack([2, 2, 2, 0])
    outputs = run_pass(layers[:3], problems[:3])
    last, p = layers[3], problems[3]
    with pytest.raises(ValueError, match="topk_ids"):
        last.submit_forward(p.hidden, torch.full_like(p.ids, E), p.weights)  # ids out of range
    outputs += run_pass(layers[3:], problems[3:])
    assert_same_total(outputs, reference)
