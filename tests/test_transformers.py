"""experts_implementation="kt_kernel" (kt_kernel.integrations.transformers) on tiny random transformers
models: each experts module and whole models against transformers' eager experts, the formats, the
parameters released, configure's checks, refused activations, chunked calls and the example."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")  # CI installs it (the test extra): a guard only

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config  # noqa: E402

import kt_kernel.integrations.transformers as kt_transformers  # noqa: E402
from kt_kernel import KTMoEWrapper, quant  # noqa: E402

from conftest import REPO, run_python  # noqa: E402

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=100, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
# MLA attention (DeepSeek, GLM-4.7-Flash): its rotary part is head_dim.
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)
# DeepSeek-style MoE: a shared expert beside the routed ones, one routing group, no dense first layer.
DEEPSEEK_MOE = dict(
    moe_intermediate_size=32, intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
    first_k_dense_replace=0, n_group=1, topk_group=1,
)  # fmt: skip
#: Per family the tiny config beyond COMMON: every layer an MoE layer, 8 experts of I = 32.
FAMILIES = {
    "qwen3_moe": dict(moe_intermediate_size=32, intermediate_size=64, num_experts=8, decoder_sparse_step=1),
    "mixtral": dict(intermediate_size=32, num_local_experts=8),
    "deepseek_v3": dict(MLA, **DEEPSEEK_MOE),
    # Interleaved, transposed gate_up with biases and the clamped SwiGLU (limit 7, alpha 1.702).
    "gpt_oss": dict(intermediate_size=32, num_local_experts=8),
    "olmoe": dict(intermediate_size=32, num_experts=8),
    "qwen2_moe": dict(
        moe_intermediate_size=32,
        intermediate_size=64,
        shared_expert_intermediate_size=32,
        num_experts=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "glm4_moe": DEEPSEEK_MOE,
    "minimax": dict(intermediate_size=32, num_local_experts=8),
    # Clamped SwiGLU without alpha: silu(min(gate, 10)) * clamp(up, -10, 10).
    "deepseek_v4": dict(MLA, **DEEPSEEK_MOE),
}
#: The families whole models are generated with (all of FAMILIES are checked module by module).
GENERATE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
TOKENS = 37  # not a multiple of anything the kernels block by

# Bounds, all relative (Frobenius norm of the difference over that of eager's output):
# BF16 rounds x, every weight, the activation between gate/up and down, and the output to bf16 (unit
# roundoff 2^-9 = 0.2 %, about 0.11 % rms each): measured 0.44-0.49 % against fp32 eager on every
# family here, and 0.32-0.34 % against eager on the bf16-rounded weights. 1 % is twice that.
BF16_BOUND = 0.01
# Whole models: the experts' error is diluted by the residual stream: logits measured 0.001-0.18 %
# (gpt_oss's the highest, its biases adding to each expert's output).
LOGITS_BOUND = 0.005


@pytest.fixture(autouse=True)
def default_settings():
    """Every test starts and ends with the default settings."""
    kt_transformers.configure()
    yield
    kt_transformers.configure()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def tiny_config(family: str, **overrides):
    return AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers dispatches through ExpertsInterface (``@use_experts_implementation``)."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def tiny_model(family: str, bias_std: float = 0.1, **overrides) -> torch.nn.Module:
    """A random fp32 model of the family; expert biases (gpt_oss) drawn nonzero."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for module in experts_modules(model):
            if module.has_bias:
                module.gate_up_proj_bias.normal_(0, bias_std)
                module.down_proj_bias.normal_(0, bias_std)
    return model


def scaled_experts(module: torch.nn.Module) -> torch.nn.Module:
    """The module with expert weights of std 3 / sqrt(fan in) (biases 0.5): with unit inputs, gate
    values of std 3 that cross gpt-oss's clamp at 7 in about one of 50 (the models' own init, std 0.02,
    never reaches it)."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            fan_in = parameter.shape[-2] if module.is_transposed else parameter.shape[-1]
            parameter.normal_(0, 0.5 if name.endswith("bias") else 3 / fan_in**0.5)
    return module


def routed_call(module: torch.nn.Module, tokens: int = TOKENS, seed: int = 1):
    """Unit-normal hidden states and a random top-2 routing of them, softmax weights."""
    generator = torch.Generator().manual_seed(seed)
    experts = module.gate_up_proj.shape[0]
    hidden = module.down_proj.shape[-1 if module.is_transposed else -2]
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2, generator=generator), dim=-1)
    return x, ids, weights


def eager(module: torch.nn.Module, *call) -> torch.Tensor:
    """transformers' own forward of the class (what experts_implementation="eager" runs)."""
    with torch.no_grad():
        return type(module).forward.__wrapped__(module, *call)


def kt_kernel(module: torch.nn.Module, *call) -> torch.Tensor:
    with torch.no_grad():
        return kt_transformers.experts_forward(module, *call)


def module_under_test(family: str) -> torch.nn.Module:
    return scaled_experts(experts_modules(tiny_model(family))[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_module_matches_eager(family):
    kt_transformers.configure(keep_weights=True)
    module = module_under_test(family)
    call = routed_call(module)
    assert relative_error(kt_kernel(module, *call), eager(module, *call)) < BF16_BOUND


def test_gpt_oss_clamp_is_crossed():
    """The gpt_oss case above means something: its gate values cross the clamp, on both sides of up."""
    module = module_under_test("gpt_oss")
    x, ids, _ = routed_call(module)
    gate_up = torch.einsum("th,thn->tn", x.repeat_interleave(2, 0), module.gate_up_proj[ids.flatten()])
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    assert (gate > module.limit).any() and (up > module.limit).any() and (up < -module.limit).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    kt_transformers.configure(keep_weights=True)
    module = module_under_test("qwen3_moe")
    x, ids, weights = routed_call(module)
    out = kt_kernel(module, x.to(dtype), ids, weights.to(dtype))
    assert out.dtype == dtype and out.shape == x.shape
    # Within bf16 (and the input's own rounding) of eager in fp32.
    assert relative_error(out, eager(module, x, ids, weights)) < BF16_BOUND


@pytest.mark.parametrize("family", GENERATE_FAMILIES)
def test_model_matches_eager(family, tmp_path):
    """from_pretrained(experts_implementation=...) of a saved tiny model: logits close, the same routing
    in every layer, and the same greedy tokens."""
    tiny_model(family).save_pretrained(tmp_path)
    models = {
        name: AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=name).eval()
        for name in ("eager", "kt_kernel")
    }
    routing = {name: [] for name in models}
    for name, model in models.items():
        for module in experts_modules(model):
            module.register_forward_hook(lambda _m, args, _out, seen=routing[name]: seen.append(args[1]))
    prompt = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = {name: model(prompt).logits for name, model in models.items()}
        generated = {
            name: model.generate(prompt, max_new_tokens=10, do_sample=False) for name, model in models.items()
        }
    # A flip of near-tied experts would change a token's output wholesale: none happens here.
    assert all(torch.equal(a, b) for a, b in zip(routing["eager"], routing["kt_kernel"], strict=True))
    assert relative_error(logits["kt_kernel"], logits["eager"]) < LOGITS_BOUND
    assert generated["kt_kernel"].shape == (2, 22)
    assert torch.equal(generated["kt_kernel"], generated["eager"])
    assert models["kt_kernel"].config._experts_implementation == "kt_kernel"


def set_model_experts(model: torch.nn.Module, name: str) -> torch.nn.Module:
    model.set_experts_implementation(name)
    return model


def stored(weight_format: str, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight as the format holds it (quantized and back) in the module's layout: the format
    quantizes rows [N, K] along K, the input dimension, as quantize-on-load does."""
    rows = weight.transpose(1, 2) if transposed else weight
    values, scales = quant.quantize(weight_format, rows)
    back = quant.dequantize(weight_format, values, scales)
    return back.transpose(1, 2) if transposed else back


# Measured against fp32 eager (weight-quantization error, qwen3_moe / gpt_oss with the weights above):
# INT8 1.0 %, FP8 4 %, INT4 17-19 %, MXFP4 19-21 %; against eager on the weights as stored 0.3 %.
@pytest.mark.parametrize("weight_format", ["INT8", "INT4", "MXFP4", "FP8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_quantized_formats(family, weight_format):
    kt_transformers.configure(weight_format=weight_format, keep_weights=True)
    module = module_under_test(family)
    as_stored = copy.deepcopy(module)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(as_stored, name).copy_(stored(weight_format, getattr(module, name), module.is_transposed))
    call = routed_call(module)
    got, want, want_stored = kt_kernel(module, *call), eager(module, *call), eager(as_stored, *call)
    assert module._kt_kernel_experts.weight_format == weight_format
    # The kernel on the stored weights: the same bf16 budget as BF16.
    assert relative_error(got, want_stored) < BF16_BOUND
    # Against fp32 eager: the weight-quantization error, plus that budget.
    quantization_error = relative_error(want_stored, want)
    assert relative_error(got, want) < quantization_error + BF16_BOUND
    assert quantization_error < {"INT8": 0.02, "FP8": 0.06, "INT4": 0.25, "MXFP4": 0.25}[weight_format]


def mxfp4_checkpoint(directory) -> None:
    """A tiny gpt-oss saved as its MXFP4 checkpoints ship: {gate_up,down}_proj_blocks [E, N, K/32, 16]
    (two E2M1 codes a byte, the low nibble first) and _scales [E, N, K/32] (E8M0), N the outputs."""
    tiny_model("gpt_oss").save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # gpt-oss holds them transposed
        codes, scales = quant.quantize("MXFP4", rows)
        tensors[f"{name}_blocks"] = codes.reshape(*rows.shape[:2], -1, 16).contiguous()
        tensors[f"{name}_scales"] = scales.view(torch.uint8).contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_runs_its_own_weights(tmp_path):
    """Without a GPU transformers dequantizes an MXFP4 checkpoint (Mxfp4Config(dequantize=True): no
    accelerate needed); MXFP4 packs those weights back exactly, so kt_kernel runs the checkpoint's
    codes, as close to eager as BF16 is."""
    mxfp4_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="kt_kernel", quantization_config=Mxfp4Config(dequantize=True)
    )
    kt_transformers.configure(weight_format="MXFP4", keep_weights=True)
    for module in experts_modules(model):
        assert type(module).__name__ == "GptOssExperts"  # transformers' own, dispatched to kt_kernel
        rows = module.gate_up_proj.detach().transpose(1, 2)
        assert torch.equal(stored("MXFP4", rows, transposed=False), rows)  # exact: nothing re-rounded
        call = routed_call(module)
        assert relative_error(kt_kernel(module, *call), eager(module, *call)) < BF16_BOUND


@pytest.mark.parametrize("keep_weights", [False, True])
def test_parameters_released_unless_kept(keep_weights):
    kt_transformers.configure(keep_weights=keep_weights)
    model = set_model_experts(tiny_model("gpt_oss"), "kt_kernel")
    before = {name: p.clone() for name, p in model.named_parameters() if ".experts." in name}
    prompt = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first = model(prompt).logits
        again = model(prompt).logits  # runs on the packed experts alone
    assert torch.equal(first, again)
    after = dict(model.named_parameters())  # still registered: only emptied
    names = {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}
    assert {name.rsplit(".", 1)[1] for name in before} == names
    for name, parameter in before.items():
        if keep_weights:
            assert torch.equal(after[name], parameter)
        else:
            assert after[name].numel() == 0, name
    wrappers = [m._kt_kernel_experts for m in experts_modules(model)]
    assert len(wrappers) == 2 and all(isinstance(w, KTMoEWrapper) for w in wrappers)
    assert wrappers[0]._pools is wrappers[1]._pools  # every layer on the same worker threads


@pytest.mark.parametrize(
    "settings, error, words",
    [
        (dict(weight_format="FP16"), ValueError, "weight_format must be one of BF16"),
        (dict(weight_format=4), TypeError, "weight_format must be a str"),
        (dict(cpuinfer_threads=0), ValueError, "cpuinfer_threads must be >= 1"),
        (dict(cpuinfer_threads=2.0), TypeError, "cpuinfer_threads must be an int"),
        (dict(cpuinfer_threads=10**6), ValueError, "CPUs this process may run on"),
        (dict(threadpool_count=0), ValueError, "threadpool_count must be >= 1"),
        (dict(cpuinfer_threads=1, threadpool_count=2), ValueError, "cannot exceed cpuinfer_threads"),
        (dict(keep_weights="yes"), TypeError, "keep_weights must be a bool"),
        (dict(chunked_prefill_size=0), ValueError, "chunked_prefill_size must be >= 1"),
        (dict(chunked_prefill_size=None), TypeError, "chunked_prefill_size is required"),
    ],
)
def test_configure_refuses_bad_values(settings, error, words):
    before = kt_transformers.configure(weight_format="INT8", keep_weights=True)
    with pytest.raises(error, match=words):
        kt_transformers.configure(**settings)
    assert kt_transformers.settings() == before  # nothing changed


def test_configure_accepts_aliases_and_defaults():
    settings = kt_transformers.configure(weight_format="amxint4")
    assert settings.weight_format == "INT4" and settings.keep_weights is False
    assert settings.cpuinfer_threads >= 1 and settings.threadpool_count == 1


def test_missing_transformers_is_a_clear_import_error():
    result = run_python(
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import kt_kernel.integrations.transformers\n"
        "except ImportError as error:\n    print(error)\n"
    )
    assert "needs transformers >= 5" in result.stdout and "kt-kernel[transformers]" in result.stdout


class ClampAfterActivation(torch.nn.Module):
    """step3p7's gate: the clamp after silu, which the kernels do not compute."""

    limit = 7.0

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)


def test_unsupported_activation_refused():
    """A GELU model fails at its first MoE call, naming the class and the activation: no fall back."""
    model = set_model_experts(tiny_model("qwen3_moe", hidden_act="gelu"), "kt_kernel")
    with pytest.raises(
        ValueError, match=r"Qwen3MoeExperts: its activation \(hidden_act 'gelu'\) is not computed"
    ):
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    assert all(m.gate_up_proj.numel() > 0 for m in experts_modules(model))  # nothing released


def test_custom_gate_refused():
    module = experts_modules(tiny_model("qwen3_moe"))[0]
    module.__class__ = type("ClampedQwen3MoeExperts", (ClampAfterActivation, type(module)), {})
    with pytest.raises(
        ValueError, match=r"ClampedQwen3MoeExperts: its activation \(ClampedQwen3MoeExperts._apply_gate"
    ):
        kt_kernel(module, *routed_call(module))


def test_ungated_experts_refused():
    module = experts_modules(tiny_model("mixtral"))[0]
    module.has_gate = False  # as nemotron_h declares its up_proj -> relu2 -> down_proj experts
    with pytest.raises(ValueError, match="MixtralExperts: experts without a gate"):
        kt_kernel(module, *routed_call(module))


def test_gradients_refused():
    """The kernels have no backward: a call that would need one is refused, not silently detached."""
    module = experts_modules(tiny_model("mixtral"))[0]
    x, ids, weights = routed_call(module)
    with pytest.raises(NotImplementedError, match="has no backward"):
        kt_transformers.experts_forward(module, x.requires_grad_(), ids, weights)


def test_chunked_calls_match_one_call():
    module = module_under_test("gpt_oss")
    chunked = copy.deepcopy(module)
    call = routed_call(module)
    whole = kt_kernel(module, *call)
    kt_transformers.configure(chunked_prefill_size=8)
    parts = kt_kernel(chunked, *call)  # 37 tokens: 4 chunks of 8 and one of 5
    assert (
        chunked._kt_kernel_experts.chunked_prefill_size == 8
        and module._kt_kernel_experts.chunked_prefill_size > TOKENS
    )
    assert torch.equal(parts, whole)


def tiny_tokenizer(directory) -> None:
    """A word-level tokenizer of the tiny models' 100 ids, saved where from_pretrained finds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 100)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)


@pytest.mark.parametrize("tokenizer", [True, False])
def test_example_generates(tokenizer, tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    if tokenizer:
        tiny_tokenizer(tmp_path)
    command = [sys.executable, str(REPO / "examples" / "transformers_generate.py"), str(tmp_path)]
    command += ["--format", "INT8", "--prompt", "w1 w2 w3", "--max-new-tokens", "5", "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert ("has no tokenizer" in result.stdout) != tokenizer
    assert "experts packed as INT8" in result.stdout
    assert "prefill: 3 tokens" in result.stdout if tokenizer else "prefill: 16 tokens" in result.stdout
    assert "decode: 4 tokens" in result.stdout and "tokens/s" in result.stdout
