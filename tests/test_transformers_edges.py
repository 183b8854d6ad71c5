"""experts_implementation="kt_kernel" in unusual setups: trainable experts, experts on the meta
device, copies of a packed model, and a packed model switched back to eager. Each is a clear error
naming the module and what to do, or works; never a silent wrong result or an error from deep inside
transformers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

pytest.importorskip("transformers")

from test_transformers import (  # noqa: E402, F401 (default_settings: autouse fixture)
    default_settings,
    experts_modules,
    kt_kernel,
    routed_call,
    set_model_experts,
    tiny_model,
)

import kt_kernel.integrations.transformers as kt_transformers  # noqa: E402

PROMPT = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(4))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def test_trainable_experts_are_refused_not_left_without_grad():
    """Fine-tuning the experts (the rest frozen): backward() ran and every expert's .grad stayed
    None. The inputs need no grad here, so only the parameters show it."""
    model = set_model_experts(tiny_model("qwen3_moe"), "kt_kernel").train()
    model.requires_grad_(False)
    for module in experts_modules(model):
        module.requires_grad_(True)
    model.lm_head.requires_grad_(True)
    with pytest.raises(
        NotImplementedError, match=r"Qwen3MoeExperts: .*no backward.*gate_up_proj, down_proj require grad"
    ):
        model(PROMPT).logits.sum().backward()
    model.eval()
    with torch.no_grad():  # inference of the same model is fine
        assert torch.isfinite(model(PROMPT).logits).all()
    module = experts_modules(tiny_model("mixtral"))[0]  # frozen experts under grad mode: nothing to refuse
    module.requires_grad_(False)
    call = routed_call(module)
    assert kt_transformers.experts_forward(module, *call).shape == call[0].shape


def test_experts_on_the_meta_device_name_the_module():
    """torch's "Cannot copy out of meta tensor" named no module."""
    with torch.device("meta"):
        model = tiny_model("mixtral")
    module = experts_modules(model)[0]
    call = routed_call(experts_modules(tiny_model("mixtral"))[0])
    with pytest.raises(ValueError, match=r"MixtralExperts\.gate_up_proj is on the meta device"):
        kt_kernel(module, *call)


def test_a_packed_model_kept_with_its_weights_copies_and_repacks_lazily():
    """keep_weights=True (docs/transformers.md: "where you need any of these"): deepcopy and pickle
    work, and the copy packs again at its first call, giving what the original gives."""
    kt_transformers.configure(keep_weights=True)
    model = set_model_experts(tiny_model("gpt_oss"), "kt_kernel")
    want = logits(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(m.__dict__.get("_kt_kernel_experts") is None for m in experts_modules(clone))
        assert torch.equal(logits(clone), want)
        packed = [m._kt_kernel_experts for m in experts_modules(clone)]
        assert all(w is not o._kt_kernel_experts for w, o in zip(packed, experts_modules(model), strict=True))


def test_a_packed_model_without_its_weights_is_a_clear_error_to_copy_or_run_eagerly():
    """keep_weights=False (the default) empties the expert parameters: a copy could not pack again
    ("cannot pickle 'MoESubpools' object" before), and transformers' eager experts raised an
    IndexError from inside it. Both now say which setting keeps the weights."""
    model = set_model_experts(tiny_model("qwen3_moe"), "kt_kernel")
    logits(model)
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(
            TypeError, match=r"keep_weights=False .* cannot be copied or pickled.*keep_weights=True"
        ):
            copier(model)
    set_model_experts(model, "eager")
    with pytest.raises(
        ValueError, match=r"Qwen3MoeExperts: experts_implementation='eager' needs .*keep_weights=True"
    ):
        logits(model)
    set_model_experts(model, "kt_kernel")  # back: the packed experts still run
    assert torch.isfinite(logits(model)).all()
    kt_transformers.configure(keep_weights=True)
    kept = set_model_experts(tiny_model("qwen3_moe"), "kt_kernel")
    want = logits(kept)
    set_model_experts(kept, "eager")  # weights kept: eager runs on them
    assert torch.allclose(logits(kept), want, rtol=0, atol=0.05 * want.abs().max().item())
