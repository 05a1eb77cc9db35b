"""Mixtures of experts: the training loss with its load-balancing term is transformers' (fp32),
a sigmoid router's (GLM-4.5) loss has no balance term and its loads count the biased choice,
the grouped expert GEMMs compute what the per-expert loop does (forward and gradients), both
checkpoint layouts load, a missing or mis-shaped expert is named, and configs a family's
class cannot build are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lathe.core.errors import CheckpointError, ConfigError
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tests.model.test_families import saved

transformers = pytest.importorskip("transformers")

MOE = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]


@pytest.mark.parametrize("name", MOE)
def test_loss_and_balance_loss_are_transformers(tmp_path, name):
    """As its config.json leaves `output_router_logits` (off), the model's loss is
    transformers' plain one — the balance loss computed and logged, not added; switched on,
    it is transformers' with the weighted balance loss, and the switch is exported (a stage
    sets it as TRL's trainers do: tests/posttrain)."""
    hf = saved(name, tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 40))
    assert not hf.config.output_router_logits and not ours.config.router_aux_loss
    with torch.no_grad():
        plain = hf(ids, labels=ids)
        balanced = hf(ids, labels=ids, output_router_logits=True)
        got = ours(ids, labels=ids)
        ours.config.router_aux_loss = True
        with_balance = ours(ids, labels=ids)
    assert float(got.router.aux_loss) == pytest.approx(float(balanced.aux_loss), abs=1e-5)
    assert float(got.loss) == pytest.approx(float(plain.loss), abs=1e-4)
    assert float(with_balance.loss) == pytest.approx(float(balanced.loss), abs=1e-4)
    assert float(balanced.loss) - float(plain.loss) > 1e-3  # the two differ
    assert float(got.router.load.sum()) == pytest.approx(1.0)
    save_checkpoint(ours, tmp_path / "lathe")
    assert json.loads((tmp_path / "lathe" / "config.json").read_text())["output_router_logits"]
    assert load_checkpoint(tmp_path / "lathe").config.router_aux_loss


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_a_padded_batchs_balance_loss_leaves_its_pads_out_as_transformers_does(tmp_path, name):
    """transformers' balance loss counts the tokens its attention_mask keeps, and lathe's
    those of its token_mask: a right-padded batch's loss and loads are transformers' with
    the pads masked, which the same batch counted whole does not give."""
    hf = saved(name, tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    ours.config.router_aux_loss = True
    ids = torch.randint(0, 256, (3, 40))
    real = torch.arange(40) < torch.tensor([40, 23, 9])[:, None]
    labels = ids.masked_fill(~real, -100)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=real.long(), labels=labels, output_router_logits=True)
        got = ours(ids, labels=labels, token_mask=real)
        whole = ours(ids, labels=labels)
    assert float(got.router.aux_loss) == pytest.approx(float(theirs.aux_loss), abs=1e-6)
    assert float(got.loss) == pytest.approx(float(theirs.loss), abs=1e-5)
    assert abs(float(whole.router.aux_loss) - float(theirs.aux_loss)) > 1e-4
    assert float(got.router.layer_load.sum()) == real.sum() * ours.config.n_experts_per_token \
        * len(got.router.layer_load)


def test_a_sigmoid_routers_loss_is_transformers_and_its_load_is_what_it_chose(tmp_path):
    """GLM-4.5's class computes no balance loss: the loss is transformers' cross-entropy, and
    the logged load counts the experts the biased, grouped choice took, layer by layer."""
    hf = saved("glm4_moe", tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        expected = hf(ids, labels=ids)
        got = ours(ids, labels=ids)
        layer = ours.model.layers[1].mlp
        hidden = torch.randn(80, ours.config.dim)
        _, chosen, _ = layer.route(hidden)
    assert float(got.loss) == pytest.approx(float(expected.loss), abs=1e-4)
    assert got.router.aux_loss is None and "router/aux_loss" not in got.router.metrics()
    assert got.router.layer_load.shape == (2, 8)  # layer 0 is dense
    assert got.router.layer_load.sum(dim=1).tolist() == [80 * 3] * 2
    # the choice is the biased one: the experts the bias favours most are taken most
    counts = torch.bincount(chosen.flatten(), minlength=8)
    layer.gate.e_score_correction_bias.copy_(torch.tensor([5.0] + [0.0] * 7))
    with torch.no_grad():
        _, favoured, weights = layer.route(hidden)
    assert (favoured == 0).any(dim=1).all() and counts[0] < 80
    assert weights.sum(dim=1).allclose(torch.full((80,), 2.5))  # renormalized, then scaled


def experts_layer(seed: int = 0):
    config = ModelConfig.from_preset("tiny", family="qwen3_moe", n_experts=8,
                                     n_experts_per_token=3, moe_ffn_hidden_dim=48, n_layers=1,
                                     vocab_size=64)
    torch.manual_seed(seed)
    return Transformer(config).model.layers[0].mlp


@pytest.mark.parametrize("dtype, gather_bytes", [
    (torch.float32, 0), (torch.float64, 64 * 2**20), (torch.float64, 0)],
    ids=["grouped-gemm", "gathered", "loop"])
def test_grouped_experts_equal_the_loop_forward_and_backward(dtype, gather_bytes, monkeypatch):
    """Each way `grouped_matmul` takes (fp32: `torch._grouped_mm`; fp64: the gathered
    batched matmul for few rows, else the loop) equals the transformers-style per-expert
    loop; one expert gets no token, which the grouped GEMM must take as an empty group."""
    from lathe.kernels import grouped_matmul
    monkeypatch.setattr(grouped_matmul, "GATHER_BYTES", gather_bytes)
    moe = experts_layer().to(dtype)
    x = torch.randn(37, 128, dtype=dtype)
    _, experts, weights = moe.route(x)
    experts = torch.where(experts == 5, 6, experts)  # expert 5 receives nothing
    weights = weights.to(dtype).requires_grad_()
    grouped = moe.experts(x, experts, weights)
    loop = moe.experts.forward_loop(x, experts, weights)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(grouped, loop, atol=tolerance, rtol=tolerance)
    upstream = torch.randn_like(grouped)
    params = [moe.experts.gate_up_proj, moe.experts.down_proj, weights]
    for a, b in zip(torch.autograd.grad(grouped, params, upstream),
                    torch.autograd.grad(loop, params, upstream), strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_the_kernel_policy_decides_whether_the_grouped_gemm_runs(monkeypatch):
    """`grouped_matmul` asks the kernel policy before `torch._grouped_mm`: with the kernel
    off (`kernels_off`, `LATHE_KERNELS_DISABLE=grouped_matmul`) the same rows take the loop
    and give the same result."""
    from lathe.kernels import grouped_matmul
    from lathe.kernels.dispatch import configure, kernels_off
    monkeypatch.setattr(grouped_matmul, "GATHER_BYTES", 0)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe = experts_layer()
    x = torch.randn(37, 128)
    _, experts, weights = moe.route(x)
    monkeypatch.delenv("LATHE_KERNELS", raising=False)
    configure()
    grouped = moe.experts(x, experts, weights)
    assert len(calls) == 2  # gate-up and down projections
    with kernels_off("grouped_matmul"):
        looped = moe.experts(x, experts, weights)
    monkeypatch.setenv("LATHE_KERNELS_DISABLE", "grouped_matmul")
    configure()
    disabled = moe.experts(x, experts, weights)
    monkeypatch.delenv("LATHE_KERNELS_DISABLE")
    configure()
    assert len(calls) == 2
    torch.testing.assert_close(looped, grouped, atol=1e-5, rtol=1e-5)
    assert torch.equal(looped, disabled)


def test_under_compile_the_expert_loop_breaks_the_graph_alone_and_equals_eager(monkeypatch):
    """Where neither the grouped GEMM nor the gathered matmul takes the rows (fp64, many
    rows), a compiled MoE layer leaves each expert loop to eager: its only graph breaks are
    the loop's calls."""
    from lathe.kernels import grouped_matmul
    monkeypatch.setattr(grouped_matmul, "GATHER_BYTES", 0)
    moe = experts_layer().to(torch.float64)
    x = torch.randn(37, 128, dtype=torch.float64)
    _, experts, weights = moe.route(x)
    weights = weights.to(torch.float64)

    def layer(x, experts, weights):
        return moe.experts(torch.relu(x) * 2, experts, weights) + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x, experts, weights)
    breaks = [reason.user_stack[-1] for reason in explained.break_reasons]
    assert breaks and all(frame.filename.endswith("grouped_matmul.py") for frame in breaks)
    assert not any(frame.name == "grouped_matmul_reference" for frame in breaks), breaks
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    torch.testing.assert_close(compiled(x, experts, weights), layer(x, experts, weights),
                               atol=1e-10, rtol=1e-10)


def test_a_fused_expert_checkpoint_loads_as_the_per_expert_one(tmp_path):
    """transformers 5's in-memory layout written to disk (one tensor per projection, all
    experts stacked) loads to the same model as `save_pretrained`'s per-expert files."""
    saved("qwen3_moe", tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    fused = {}
    for name, tensor in state.items():
        if ".mlp.experts." not in name:
            fused[name] = tensor
    for layer in (0,):  # layer 1 is dense (mlp_only_layers)
        prefix = f"model.layers.{layer}.mlp.experts"
        stacked = {p: torch.stack([state[f"{prefix}.{e}.{p}.weight"] for e in range(6)])
                   for p in ("gate_proj", "up_proj", "down_proj")}
        fused[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1)
        fused[f"{prefix}.down_proj"] = stacked["down_proj"]
    folder = tmp_path / "fused"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file(fused, folder / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(folder)(ids).logits,
                                   load_checkpoint(tmp_path / "hf")(ids).logits)


@pytest.mark.parametrize("damage, message", [
    ("drop", "model.layers.0.block_sparse_moe.experts.3.w2.weight is missing"),
    ("reshape", "model.layers.0.block_sparse_moe.experts.3.w2.weight has shape (64, 100), "
                "expected (64, 128)"),
])
def test_a_missing_or_misshaped_expert_is_named(tmp_path, damage, message):
    saved("mixtral", tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    key = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    if damage == "drop":
        del state[key]
    else:
        state[key] = state[key][:, :100].contiguous()
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_checkpoint(tmp_path / "hf")


def test_configs_a_family_cannot_build_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="family='llama' is dense"):
        ModelConfig(n_experts=4)
    with pytest.raises(ConfigError, match="family='mixtral' is a mixture of experts; set "
                                          "n_experts"):
        ModelConfig(family="mixtral")
    with pytest.raises(ConfigError, match="family='mixtral' has experts in every layer"):
        ModelConfig(family="mixtral", n_experts=4, n_layers=2, moe_layers=[1, 0])
    with pytest.raises(ConfigError, match="n_experts_per_token=5 exceeds n_experts=4"):
        ModelConfig(family="olmoe", qk_norm_projection=True, n_experts=4, n_experts_per_token=5)
    saved("mixtral", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config,
                                                             "router_jitter_noise": 0.1}))
    with pytest.raises(CheckpointError, match="router_jitter_noise=0.1 is not supported"):
        load_checkpoint(tmp_path / "hf")


def test_a_glm_checkpoints_multi_token_prediction_layer_is_ignored(tmp_path):
    """GLM-4.5's checkpoints carry a multi-token-prediction block as the layer after the
    last (`num_nextn_predict_layers`), which its class does not build: a load skips it."""
    saved("glm4_moe", tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        expected = load_checkpoint(tmp_path / "hf")(ids).logits
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    mtp = {name.replace("model.layers.2.", "model.layers.3."): tensor.clone()
           for name, tensor in state.items() if name.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**state, **mtp}, file, metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config,
                                                             "num_nextn_predict_layers": 1}))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "hf")(ids).logits, expected)


def test_a_sigmoid_routers_configs_its_class_cannot_build_are_refused():
    glm = dict(family="glm4_moe", sigmoid_router=True, n_experts=8, router_aux_loss_coef=0.0)
    with pytest.raises(ConfigError, match="glm4_moe'.s class computes no balance loss"):
        ModelConfig(**{**glm, "router_aux_loss_coef": 0.01})
    with pytest.raises(ConfigError, match="are a sigmoid router's"):
        ModelConfig(family="qwen3_moe", qk_norm=True, n_experts=8, n_expert_groups=2)
    with pytest.raises(ConfigError, match="must split into groups of at least 2"):
        ModelConfig(**glm, n_expert_groups=3)
    with pytest.raises(ConfigError, match="leaves fewer experts than n_experts_per_token=3"):
        ModelConfig(**glm, n_expert_groups=4, topk_expert_groups=1, n_experts_per_token=3)
    with pytest.raises(ConfigError, match="put the 0s first"):
        ModelConfig(**glm, moe_layers=[1, 0, 1, 1])
    with pytest.raises(ConfigError, match="a multiple of moe_ffn_hidden_dim=64"):
        ModelConfig(**glm, moe_ffn_hidden_dim=64, shared_expert_dim=96)
    hf = {"model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 128, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    for key, value in (("first_k_dense_replace", "1"), ("n_shared_experts", "2")):
        with pytest.raises(ConfigError, match=f"{key}='{value}' must be an integer >= 0"):
            ModelConfig.from_hf_config({**hf, key: value})
    with pytest.raises(ConfigError, match="routed_scaling_factor='x' must be a number > 0"):
        ModelConfig.from_hf_config({**hf, "routed_scaling_factor": "x"})


def test_a_new_glm4_moe_model_loads_in_transformers_with_its_logits(tmp_path):
    """`lathe init --family glm4_moe`'s model (a shared expert, as GLM-4.5 has; a selection
    bias, here moved off zero as balancing would) is a `Glm4MoeForCausalLM` with its logits."""
    from lathe.model import save_checkpoint
    config = ModelConfig.from_preset("tiny", family="glm4_moe", vocab_size=256)
    assert (config.sigmoid_router, config.router_aux_loss_coef) == (True, 0.0)
    assert config.shared_expert_dim == config.moe_ffn_hidden_dim
    torch.manual_seed(0)
    model = Transformer(config)
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    save_checkpoint(model, tmp_path / "glm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "glm",
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    assert sum(t.numel() for t in hf.state_dict().values()) == \
        sum(t.numel() for t in model.state_dict().values())  # both hold the tied head
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=1e-4, rtol=0)
    # loaded in bf16, the selection bias stays fp32, as transformers keeps it
    bf16 = load_checkpoint(tmp_path / "glm", dtype=torch.bfloat16)
    gate = bf16.model.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(gate.e_score_correction_bias,
                               model.model.layers[0].mlp.gate.e_score_correction_bias)


def test_active_parameters_count_the_experts_a_token_uses():
    config = ModelConfig.from_preset("tiny", family="qwen3_moe", n_experts=8,
                                     n_experts_per_token=2, moe_ffn_hidden_dim=64,
                                     moe_layers=[1, 0, 1, 1])
    model = Transformer(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.dim * 64
    dense = ModelConfig.from_preset("tiny", family="qwen3")
    moe_layers = 3
    attention_and_head = dense.flops_per_token(0) // 6 - 4 * 3 * dense.dim * dense.ffn_hidden_dim
    assert config.flops_per_token(0) // 6 == (attention_and_head + 3 * dense.dim
                                              * dense.ffn_hidden_dim
                                              + moe_layers * (2 * per_expert + 8 * config.dim))


# int4's groups of 32 on this sharpened random model: 13% mean error (a broken expert: ~100%)
@pytest.mark.parametrize("family", ["olmoe", "glm4_moe"])
@pytest.mark.parametrize("mode, tolerance", [("int8", 0.02), ("int4", 0.2)])
def test_quantized_experts_serve_close_to_full_precision(tmp_path, mode, tolerance, family):
    """Every linear and every expert quantized (routers kept): logits within the mode's
    mean error, the weights a fraction of the bytes, and a quantized checkpoint reloads to
    the same model."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.quant import (
        QuantizedExperts,
        load_serving_model,
        save_quantized_checkpoint,
        weight_bytes,
    )
    from lathe.serve.sampling_params import SamplingParams

    saved(family, tmp_path / "hf")
    full = load_checkpoint(tmp_path / "hf")
    quantized = load_serving_model(tmp_path / "hf", quantize=mode, device="cpu")
    assert sum(isinstance(m, QuantizedExperts) for m in quantized.modules()) == 2
    assert weight_bytes(quantized) < 0.45 * weight_bytes(full)
    ids = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        expected, got = full(ids).logits, quantized(ids).logits
    assert (got - expected).abs().mean() <= tolerance * expected.abs().mean()
    save_quantized_checkpoint(tmp_path / "hf", tmp_path / "q", mode)
    reloaded = load_serving_model(tmp_path / "q", device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, got)
    engine = LLMEngine(reloaded, None, EngineConfig(num_blocks=32), eos_token_ids=[])
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=6, temperature=0,
                                                             ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_compiled_decode_and_speculation_serve_a_moe_as_eager_does(tmp_path):
    """The static-shape compiled decode step (expert counts in fixed slots, no host sync)
    and draft speculation give the eager engine's greedy tokens."""
    from lathe.serve.config import EngineConfig, SpeculativeConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    saved("qwen3_moe", tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf")
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    base = {"block_size": 4, "num_blocks": 128, "max_num_seqs": 4}

    def tokens(engine: LLMEngine) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    eager = tokens(LLMEngine(model, config=EngineConfig(**base)))
    assert tokens(LLMEngine(model, config=EngineConfig(**base, compile_decode=True))) == eager
    draft = load_checkpoint(tmp_path / "hf")
    assert tokens(LLMEngine(model, config=EngineConfig(
        **base, speculative=SpeculativeConfig("draft", 3)), draft_model=draft)) == eager


@pytest.mark.filterwarnings("error:All adapters are already merged")  # said after every run
def test_lora_adapts_the_stacked_experts_and_merges_exactly(tmp_path):
    """gate_proj/up_proj and down_proj targets reach a MoE's stacked experts (peft's
    target_parameters, a rank-r update per expert): the adapter saves and reloads exactly,
    merges exactly (a wrapper around a wrapper, level by level), GRPO's merger gives the
    same weights, and the engine's adapter slots refuse it with the way to serve it."""
    from lathe.model import save_checkpoint
    from lathe.model.lora import (
        AdapterMerger,
        LoraSection,
        adapter_weights,
        apply_lora,
        load_adapter,
        merge_lora,
        save_adapter,
    )
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine

    config = ModelConfig.from_preset("tiny", family="mixtral", n_experts=4, n_layers=2,
                                     vocab_size=64)
    torch.manual_seed(0)
    base = Transformer(config)
    save_checkpoint(base, tmp_path / "base")
    section = LoraSection(enabled=True, r=4, target_modules=["q_proj", "gate_proj",
                                                             "down_proj"])
    model = apply_lora(load_checkpoint(tmp_path / "base"), section)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        adapted = model(ids).logits
        assert not torch.allclose(adapted, base(ids).logits)
    save_adapter(model, section, tmp_path / "adapter", tmp_path / "base")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert written["target_modules"] == ["q_proj"]  # no dense MLP to name
    reloaded = load_adapter(load_checkpoint(tmp_path / "base"), tmp_path / "adapter")
    merger_state = AdapterMerger(load_checkpoint(tmp_path / "base"), section)(
        adapter_weights(model))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, adapted, atol=1e-6, rtol=1e-6)
        merged = merge_lora(reloaded)
        assert type(merged.model.layers[0].mlp.experts).__name__ == "Experts"
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-5, rtol=1e-5)
        plain = load_checkpoint(tmp_path / "base")
        plain.load_state_dict(merger_state)
        torch.testing.assert_close(plain(ids).logits, adapted, atol=1e-5, rtol=1e-5)
    engine = LLMEngine.from_checkpoint(tmp_path / "base", EngineConfig(num_blocks=16,
                                                                       max_loras=1))
    with pytest.raises(CheckpointError, match="adapter slots do not serve; serve the merged "
                                              "model"):
        engine.add_adapter("a", tmp_path / "adapter")
