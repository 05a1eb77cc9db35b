"""Qwen3-Next: Qwen3.5-MoE's layers (Gated DeltaNet and gated full attention, Qwen2-MoE's
experts beside a sigmoid-gated shared expert) whose checkpoints fuse each DeltaNet's q, k, v
and z projections into `in_proj_qkvz` and its b and a into `in_proj_ba`, rows grouped by key
head. Checked against transformers' own class on tiny models it builds and `save_pretrained`
writes: logits and gradients, an export that is transformers' state dict again, generation
through the recurrent state, a LoRA adapter on the fused projections that peft computes as
lathe does and the engine's slots serve, and a GGUF that llama.cpp's qwen3next runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lathe.core.errors import CheckpointError, ConfigError
from lathe.model import ModelConfig, load_checkpoint, save_checkpoint
from lathe.model.families import join_fused
from tests.model.test_qwen3_5 import (
    adapted,
    full_forward_greedy,
    generates_as_transformers,
    llama_cpp_error,
)

transformers = pytest.importorskip("transformers")

# two value heads a key head, four experts (two a token) in every layer but the second
NEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])


def hf_model(folder=None, **extra):
    """transformers' Qwen3-Next with its random weights moved where a wrong layer shows:
    every (1 + w) norm off 1, the decays and step biases spread, routers decisive."""
    config = transformers.Qwen3NextConfig(**{**NEXT, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "mlp.gate.weight")) \
                    and "linear_attn.norm" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator)
                                * (0.3 if "norm" in name else 1.0))
            elif name.endswith(("in_proj_qkvz.weight", "q_proj.weight", "k_proj.weight")):
                parameter.mul_(4)
        model.lm_head.weight.mul_(30)
    if folder is not None:
        model.save_pretrained(folder)
    return model


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_it_loads_and_exports_as_transformers_class_with_its_logits(tmp_path):
    hf = hf_model(tmp_path / "hf")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in hf.state_dict()
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert ours.config.moe_layers == [1, 0, 1, 1]
        assert ours.config.partial_rotary_factor == 0.25
        assert relative(ours(ids).logits, expected) <= 1e-5
    assert ours.config.num_params() == sum(p.numel() for p in hf.parameters())
    save_checkpoint(ours, tmp_path / "lathe")
    written = json.loads((tmp_path / "lathe" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (
        "qwen3_next", ["Qwen3NextForCausalLM"])
    stored = load_file(next((tmp_path / "lathe").glob("*.safetensors")))
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in stored
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again) is type(hf) and again.config.mlp_only_layers == [1]
    theirs = again.state_dict()
    assert set(theirs) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():  # the fused rows back in their order
        assert torch.equal(theirs[name], tensor), name
    with torch.no_grad():
        assert relative(again(ids).logits, expected) <= 1e-5


def test_gradients_are_transformers(tmp_path):
    """With the balance loss off (transformers adds it only where asked for router logits,
    lathe's training loss always carries it)."""
    hf = hf_model(tmp_path / "hf", router_aux_loss_coef=0.0).train()
    ours = load_checkpoint(tmp_path / "hf").train()
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(4))
    hf(ids, labels=ids).loss.backward()
    ours(ids, labels=ids, return_logits=False).loss.backward()
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    grads = join_fused({name: p.grad for name, p in ours.named_parameters()}, ours.config)
    assert set(grads) == set(theirs)
    for name, grad in grads.items():
        reference = theirs[name]
        assert (grad - reference).abs().max() <= 1e-4 * reference.abs().max() + 1e-8, name


def test_generation_and_the_engine_follow_transformers(tmp_path):
    """`generate` (the chunked rule over the prompt, then the recurrence) gives transformers'
    greedy tokens; so does the paged engine, prompts in chunks beside other decodes, its
    decodes eager or compiled (the experts and the states in one graph)."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_model(tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    generates_as_transformers(hf, ours, 16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 90, 33)]
    for compiled in (False, True):
        served = LLMEngine(ours, config=EngineConfig(num_blocks=64, max_num_batched_tokens=48,
                                                     max_num_seqs=4, compile_decode=compiled))
        outputs = served.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == full_forward_greedy(hf, prompt, 12)
    assert served.runner.graphs.steps > 0


def test_a_lora_adapter_on_the_fused_projections_is_pefts_and_served(tmp_path):
    """An adapter on the DeltaNet's q/k/v, z, b and a (lathe's split projections) is written
    on the class's fused `in_proj_qkvz` and `in_proj_ba` (rows interleaved as theirs): peft
    on Qwen3NextForCausalLM computes lathe's adapted logits, lathe reads it back, and an
    engine slot serves it with the merged model's greedy tokens."""
    from peft import PeftModel

    from lathe.model.lora import LoraSection, load_adapter, merge_lora, save_adapter
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf_model(tmp_path / "hf")
    section = LoraSection(enabled=True, r=4, alpha=8, target_modules=[
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj"])
    model = adapted(tmp_path / "hf", section, seed=5)
    save_adapter(model, section, tmp_path / "adapter", tmp_path / "hf")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".linear_attn.in_proj_qkvz.lora_B" in name for name in written)
    assert any(".linear_attn.in_proj_ba.lora_B" in name for name in written)
    ids = torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(6))
    theirs = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = model(ids).logits
        assert relative(load_checkpoint(tmp_path / "hf")(ids).logits, ours) > 1e-2
        assert relative(theirs(ids).logits, ours) <= 1e-5
        reloaded = load_adapter(load_checkpoint(tmp_path / "hf"), tmp_path / "adapter")
        assert relative(reloaded(ids).logits, ours) <= 1e-5
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_loras=1, max_lora_rank=16))
    engine.add_adapter("next", tmp_path / "adapter")
    merged = merge_lora(model).eval()
    prompt = ids[0, :25].tolist()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    served = engine.generate([prompt], params, adapter="next")[0].outputs[0].token_ids
    assert served == LLMEngine(merged, config=EngineConfig(num_blocks=64)).generate(
        [prompt], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("key_heads", [2, 4], ids=["grouped-values", "one-value-a-key"])
def test_its_gguf_gives_llama_cpps_logits(tmp_path, key_heads):
    """Exported as llama.cpp's qwen3next (the fused `ssm_in` and `ssm_ba` as the class
    stores them, value heads grouped by key head; A = −exp(A_log); plain partial RoPE),
    llama.cpp computes lathe's logits over 120 tokens."""
    from tests import llama_cpp_runtime

    llama_cpp_runtime.library()
    hf = hf_model(vocab_size=403, mlp_only_layers=[], linear_num_key_heads=key_heads)
    error, _ = llama_cpp_error(hf, tmp_path / "hf", 120)
    assert error < 1e-4


@pytest.mark.parametrize(("changes", "reason"), [
    ({"mlp_only_layers": [1]}, "has experts in every layer"),
    ({"linear_value_head_dim": 16}, "value heads as wide as its key heads"),
    ({"shared_expert_intermediate_size": 0}, "needs its shared expert"),
])
def test_what_llama_cpps_qwen3next_cannot_hold_is_refused(changes, reason):
    from lathe.serve.gguf_export import unwritable

    config = ModelConfig.from_hf_config(transformers.Qwen3NextConfig(**{**NEXT, **changes})
                                        .to_dict())
    assert reason in unwritable(config)
    assert unwritable(ModelConfig.from_hf_config(transformers.Qwen3NextConfig(**{
        **NEXT, "mlp_only_layers": []}).to_dict())) is None


def test_its_config_json_reads_as_its_class_does():
    """What the class defaults (a quarter of each head turned by RoPE, 80B-A3B's experts)
    is read where config.json leaves it out; a Qwen3-Next without experts is refused."""
    full = transformers.Qwen3NextConfig(**NEXT).to_dict()
    sparse = {key: value for key, value in full.items()
              if key not in ("rope_parameters", "num_experts", "num_experts_per_tok")}
    config = ModelConfig.from_hf_config(sparse)
    assert (config.partial_rotary_factor, config.n_experts, config.n_experts_per_token) == (
        0.25, 512, 10)
    with pytest.raises(ConfigError, match="num_experts=0"):
        ModelConfig.from_hf_config({**full, "num_experts": 0})


def test_a_fused_projection_of_the_wrong_width_is_refused_by_name(tmp_path):
    hf_model(tmp_path / "hf")
    weights = next((tmp_path / "hf").glob("*.safetensors"))
    state = load_file(weights)
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    state[name] = state[name][:-8]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="in_proj_qkvz"):
        load_checkpoint(tmp_path / "hf")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_export_keeps_the_fused_rows_and_their_scales(tmp_path, mode):
    """`lathe export --format quantized` joins the quantized q/k/v and z into the class's
    `in_proj_qkvz`, each row's scale moving with it (b and a stay full precision): the
    folder serves with the logits of the model quantized in memory."""
    from lathe.serve.quant import load_serving_model, save_quantized_checkpoint
    from tests.builders import build_qwen3_5_tokenizer

    hf_model(tmp_path / "hf", hidden_size=128, linear_key_head_dim=16,
             linear_value_head_dim=16, moe_intermediate_size=64,
             shared_expert_intermediate_size=64)
    build_qwen3_5_tokenizer(tmp_path / "hf", vocab_size=256)
    out = save_quantized_checkpoint(tmp_path / "hf", tmp_path / mode, mode, group_size=32)
    stored = load_file(next(out.glob("*.safetensors")))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight_scale" in stored
    assert stored["model.layers.0.linear_attn.in_proj_ba.weight"].is_floating_point()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = load_serving_model(tmp_path / "hf", quantize=mode, group_size=32,
                                      device="cpu")(ids).logits
        assert relative(load_serving_model(out, device="cpu")(ids).logits, expected) <= 1e-5


def test_an_adapter_on_the_fused_projections_and_the_experts_is_pefts(tmp_path):
    """Beside the fused projections' stacks (twice the rank wide), the stacked experts'
    adapters (peft's target_parameters) are padded expert by expert to that rank: peft on
    the class computes lathe's adapted logits, and lathe reads the folder back."""
    from peft import PeftModel

    from lathe.model.lora import LoraSection, load_adapter, save_adapter

    hf_model(tmp_path / "hf")
    section = LoraSection(enabled=True, r=4, alpha=8,
                          target_modules=["in_proj_qkv", "in_proj_z", "down_proj"])
    model = adapted(tmp_path / "hf", section, seed=6)
    save_adapter(model, section, tmp_path / "adapter", tmp_path / "hf")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert config["target_parameters"] and "experts" not in config["target_modules"]
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(7))
    theirs = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = model(ids).logits
        assert relative(theirs(ids).logits, ours) <= 1e-5
        reloaded = load_adapter(load_checkpoint(tmp_path / "hf"), tmp_path / "adapter")
        assert relative(reloaded(ids).logits, ours) <= 1e-5
