"""Quantized checkpoints in compressed-tensors' format, against the real thing: a checkpoint
compressed-tensors itself writes (as llm-compressor's round-to-nearest W4A16 / W8A16
recipes do) loads into lathe's quantized linears with the weights transformers
decompresses; an FP8_DYNAMIC one serves with transformers' logits (each token's inputs
rounded to float8), and every FP8 one trains from the weights transformers decompresses; the
checkpoints lathe writes load in transformers with lathe's weights (FP8: the library's own
bytes); any other scheme is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from lathe.kernels.quant_matmul import dequantize_int4, dequantize_int8
from lathe.model import load_checkpoint
from lathe.model.checkpoint import CheckpointError
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import (
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    load_serving_model,
    save_quantized_checkpoint,
)
from lathe.serve.sampling_params import SamplingParams
from tests.model.test_families import with_tokenizer

transformers = pytest.importorskip("transformers")
compressed_tensors = pytest.importorskip("compressed_tensors")

SHAPE = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, tie_word_embeddings=False)

SCHEMES = {  # llm-compressor's presets, in round-to-nearest
    "W4A16": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    "W4A16_ASYM-g32": dict(num_bits=4, type="int", symmetric=False, strategy="group",
                           group_size=32),
    "W8A16": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
}


def compressed_by_the_library(folder, scheme: dict, fmt: str = "pack-quantized",
                              family: str = "Qwen3", shape: dict | None = None,
                              activations: dict | None = None):
    """A model of `family` quantized and saved by compressed-tensors: each linear but the
    head given round-to-nearest scales and zero points (`calculate_qparams` over its rows,
    groups or whole weight, as llm-compressor's min-max observer computes them), its
    inputs quantized as `activations` says, compressed by the library's ModelCompressor
    and written by save_pretrained."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    config = getattr(transformers, f"{family}Config")(**(shape or SHAPE))
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # attention that is not uniform
            attention = layer.self_attn
            getattr(attention, "q_proj", getattr(attention, "qkv_proj", None)).weight.mul_(4)
    args = QuantizationArgs(**scheme)
    inputs = QuantizationArgs(**activations) if activations else None
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args,
                                                     input_activations=inputs)},
        ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED))
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        weight = module.weight.data
        if args.strategy == "block":  # (row blocks, column blocks, a block's values)
            r, c = args.block_structure
            rows = weight.reshape(weight.shape[0] // r, r, -1, c).transpose(1, 2).flatten(2)
        else:
            rows = (weight.reshape(weight.shape[0], -1, args.group_size) if args.group_size
                    else weight.reshape(1, 1, -1) if args.strategy == "tensor"
                    else weight[:, None, :])
        scale, zero_point = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(
            module.weight_scale.dtype)
        if getattr(module, "weight_zero_point", None) is not None:
            module.weight_zero_point.data = zero_point.reshape(
                module.weight_zero_point.shape).to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    with_tokenizer(folder, vocab_size=300)
    return folder


def decompressed(folder):
    """transformers' model of a compressed-tensors folder, its weights decompressed."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)).eval()


def dequantized(linear) -> torch.Tensor:
    if isinstance(linear, Int4Linear):
        return dequantize_int4(linear.weight, linear.scale, linear.minimum)
    assert isinstance(linear, Int8Linear)
    return dequantize_int8(linear.weight, linear.scale)


def linears(model):
    """(name, module) of each projection of lathe's model or transformers'."""
    for i, layer in enumerate(model.model.layers):
        for group in ("self_attn", "mlp"):
            for name, module in getattr(layer, group).named_children():
                if name.endswith("_proj"):
                    yield f"{i}.{group}.{name}", module


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_checkpoint_the_library_compressed_serves_with_the_weights_transformers_reads(
        tmp_path, scheme):
    """Each linear holds exactly the weights transformers decompresses (int4 as nibbles,
    scale and minimum; int8 as ints and scale); the head stays full precision; the logits
    are transformers' to the CPU GEMMs' bf16 rounding of activations; the engine serves it."""
    folder = compressed_by_the_library(tmp_path / "ct", SCHEMES[scheme])
    reference = decompressed(folder)
    ours = load_serving_model(folder, device="cpu")
    kind = Int8Linear if scheme == "W8A16" else Int4Linear
    theirs = dict(linears(reference))
    for name, linear in linears(ours):
        assert isinstance(linear, kind), name
        torch.testing.assert_close(dequantized(linear), theirs[name].weight, rtol=1e-6,
                                   atol=1e-7, msg=name)
    assert isinstance(ours.lm_head, torch.nn.Linear)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, ours(ids).logits
    assert (got - expected).abs().max() / expected.abs().max() < 2e-2
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=32))
    (output,) = engine.generate([ids[0, :8].tolist()], SamplingParams(max_tokens=4,
                                                                       temperature=0))
    assert len(output.outputs[0].token_ids) == 4


@pytest.mark.parametrize("family", ["Qwen2", "Phi3"])
def test_biases_and_fused_projections_load_from_compressed_tensors(tmp_path, family):
    """Qwen2's q/k/v biases stay full precision beside their quantized weights; Phi-3's
    fused qkv and gate_up projections split into lathe's, their scales and zero points by
    the same rows: the logits are transformers' to the CPU GEMMs' rounding."""
    shape = {key: value for key, value in SHAPE.items() if key != "head_dim"}
    folder = compressed_by_the_library(tmp_path / "ct", SCHEMES["W4A16_ASYM-g32"],
                                       family=family, shape={**shape, "pad_token_id": 0})
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = decompressed(folder)(ids).logits
        got = load_serving_model(folder, device="cpu")(ids).logits
    assert (got - expected).abs().max() / expected.abs().max() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", [*SCHEMES, "FP8_DYNAMIC"])
def test_a_compressed_checkpoint_serves_on_cuda_with_transformers_logits(tmp_path, scheme):
    """On a GPU the quantized linears run lathe's Triton kernels over the format's weights,
    scales and minimums in bf16 (FP8: FP8 tensor cores where the GPU has them, its inputs
    rounded as transformers fake-quantizes them): transformers' bf16 logits, to bf16's
    rounding; the engine generates."""
    fp8 = scheme == "FP8_DYNAMIC"
    folder = fp8_by_the_library(tmp_path / "ct") if fp8 else \
        compressed_by_the_library(tmp_path / "ct", SCHEMES[scheme])
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    reference = (served_by_transformers if fp8 else decompressed)(folder).to(
        "cuda", torch.bfloat16)
    ours = load_serving_model(folder, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected, got = reference(ids).logits.float(), ours(ids).logits.float()
    assert (got - expected).abs().max() / expected.abs().max() < 5e-2
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=32))
    (output,) = engine.generate([ids[0, :8].tolist()], SamplingParams(max_tokens=4,
                                                                       temperature=0))
    assert len(output.outputs[0].token_ids) == 4


def test_the_older_int_quantized_format_reads_the_same(tmp_path):
    """W8A16 written as `int-quantized` (int8 stored unpacked) reads as the packed one."""
    packed = load_serving_model(compressed_by_the_library(
        tmp_path / "packed", SCHEMES["W8A16"]), device="cpu")
    plain = load_serving_model(compressed_by_the_library(
        tmp_path / "plain", SCHEMES["W8A16"], fmt="int-quantized"), device="cpu")
    for (name, a), (_, b) in zip(linears(packed), linears(plain), strict=True):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.scale, b.scale), name


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_lathes_quantized_export_loads_in_transformers_with_lathes_weights(
        checkpoint, tmp_path, mode):
    """`lathe export --format quantized` is compressed-tensors' format: transformers
    decompresses each linear to the weight lathe serves, and its logits are lathe's
    quantized model's computed in float32."""
    out = save_quantized_checkpoint(checkpoint, tmp_path / mode, mode, group_size=32)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    ours = load_serving_model(out, device="cpu")
    theirs = decompressed(out)
    expected = {name: dequantized(linear) for name, linear in linears(ours)}
    for name, linear in linears(theirs):
        torch.testing.assert_close(linear.weight, expected[name], rtol=1e-6, atol=1e-7,
                                   msg=name)
    full = load_checkpoint(checkpoint)
    with torch.no_grad():
        for name, linear in linears(full):
            linear.weight.copy_(expected[name])
        ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(theirs(ids).logits, full(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("change", "field"), [
    ({"input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                            "strategy": "token", "dynamic": True}}, "input_activations"),
    ({"weights": {"num_bits": 8, "type": "float", "symmetric": True,
                  "strategy": "channel"}}, "format"),
    ({"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                  "group_size": 16}}, "weights.group_size"),
    ({"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group",
                  "group_size": 128}}, "weights.strategy"),
])
def test_schemes_lathes_kernels_do_not_compute_are_refused_by_field(tmp_path, change, field):
    folder = compressed_by_the_library(tmp_path / "ct", SCHEMES["W4A16"])
    config = json.loads((folder / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config_groups\.group_0\.{field}"):
        load_serving_model(folder, device="cpu")


def test_other_quantization_methods_and_training_on_a_quantized_checkpoint_are_refused(
        tmp_path):
    from lathe.core.errors import ConfigError
    folder = compressed_by_the_library(tmp_path / "ct", SCHEMES["W4A16"])
    with pytest.raises(ConfigError, match="on the CPU what stays full precision is float32"):
        load_serving_model(folder, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(CheckpointError, match=r"quantized \(compressed-tensors\).*full-precision"):
        load_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='gptq': not compressed-tensors"):
        load_serving_model(folder, device="cpu")


@pytest.mark.parametrize(("fp8", "tensor", "change", "message"), [
    (False, "weight_scale", lambda t: t[:, :3], r"up_proj\.weight_scale has shape \(256, 3\)"),
    (False, "weight_shape", lambda t: torch.tensor([256, 1 << 40]),
     r"up_proj\.weight_packed torch.int32 \(256, 16\) does not hold a weight of weight_shape"),
    (False, "weight_zero_point", lambda t: t[:1],
     r"up_proj\.weight_zero_point has shape \(1, 4\)"),
    (True, "weight", lambda t: t.to(torch.bfloat16),
     r"up_proj\.weight must be a 2-D float8_e4m3fn"),
    (True, "weight_scale", lambda t: t[:3], r"up_proj\.weight_scale has shape \(3, 1\)"),
])
def test_a_corrupt_quantized_linear_is_a_checkpoint_error(tmp_path, fp8, tensor, change,
                                                          message):
    """A scale, shape or zero point that does not fit its packed weight (an FP8 weight not
    float8, a scale not one a row) is refused, naming it, before anything the size it
    claims is allocated."""
    from safetensors.torch import load_file, save_file
    folder = fp8_by_the_library(tmp_path / "ct") if fp8 else \
        compressed_by_the_library(tmp_path / "ct", SCHEMES["W4A16_ASYM-g32"])
    state = load_file(folder / "model.safetensors")
    name = f"model.layers.0.mlp.up_proj.{tensor}"
    state[name] = change(state[name]).contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        load_serving_model(folder, device="cpu")


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_lathe_rounds_as_compressed_tensors_rounds_its_presets(mode):
    """lathe's quantizers give compressed-tensors' own round-to-nearest result for
    W4A16_ASYM (groups of 32) and W8A16 — zero rows, one-signed groups and outliers
    included — so a model quantized at load serves what llm-compressor would have written."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from lathe.serve.quant import quantize_int4, quantize_int8
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=g)
    weight[0] = 0
    weight[1] = weight[1].abs()
    weight[2, 5] = 40.0
    if mode == "int4":
        args = QuantizationArgs(**SCHEMES["W4A16_ASYM-g32"])
        groups = weight.reshape(64, -1, 32)
        ours = dequantize_int4(*quantize_int4(weight, 32))
    else:
        args = QuantizationArgs(**SCHEMES["W8A16"])
        groups = weight[:, None, :]
        ours = dequantize_int8(*quantize_int8(weight))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    if mode == "int8":
        scale, zero_point = scale.reshape(-1, 1), zero_point.reshape(-1, 1)
    theirs = fake_quantize(weight, scale, zero_point, args)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_a_bf16_checkpoint_exports_its_full_precision_rest_in_bf16(checkpoint, tmp_path):
    """The embedding, norms and head keep the source's bf16 (not float32, twice the
    bytes); the scales stay the float32 ones the ints were rounded with."""
    from safetensors import safe_open

    from lathe.model import save_checkpoint
    source = save_checkpoint(load_checkpoint(checkpoint, dtype=torch.bfloat16),
                             tmp_path / "bf16", tokenizer=checkpoint)
    out = save_quantized_checkpoint(source, tmp_path / "int4", "int4", group_size=32)
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16
        assert weights.get_tensor(
            "model.layers.0.self_attn.q_proj.weight_scale").dtype == torch.float32
    served = load_serving_model(out, device="cpu")
    assert served.model.embed_tokens.weight.dtype == torch.float32  # the CPU computes in it


FP8_WEIGHTS = {strategy: dict(num_bits=8, type="float", symmetric=True, strategy=strategy)
               for strategy in ("channel", "tensor")}
FP8_TOKENS = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)


def fp8_by_the_library(folder, strategy: str = "channel", **kwargs):
    """FP8_DYNAMIC (or its per-tensor-weight variant) as compressed-tensors writes it."""
    return compressed_by_the_library(folder, FP8_WEIGHTS[strategy], fmt="float-quantized",
                                     activations=FP8_TOKENS, **kwargs)


def served_by_transformers(folder):
    """transformers' model of a compressed-tensors folder as it serves it by default: the
    weights decompressed, each linear's inputs fake-quantized as the scheme says."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_an_fp8_dynamic_checkpoint_serves_as_transformers_computes_it(tmp_path, strategy):
    """Each linear holds the library's float8 values and scales (a tensor's one scale for
    each row); the logits are transformers' — each token's inputs rounded to float8, which
    moves them far more than float32's rounding (the weights alone are 1e-2 away) — and the
    engine's greedy tokens are transformers' `generate`."""
    folder = fp8_by_the_library(tmp_path / "fp8", strategy)
    reference = served_by_transformers(folder)
    ours = load_serving_model(folder, device="cpu")
    theirs = dict(linears(decompressed(folder)))
    for name, linear in linears(ours):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn
        assert linear.scale.dtype == torch.float32
        torch.testing.assert_close(linear.weight.float() * linear.scale[:, None],
                                   theirs[name].weight, rtol=0, atol=0, msg=name)
    assert isinstance(ours.lm_head, torch.nn.Linear)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, ours(ids).logits
        weights_only = decompressed(folder)(ids).logits
    scale = expected.abs().max()
    assert (got - expected).abs().max() / scale < 1e-5
    assert (weights_only - expected).abs().max() / scale > 1e-3
    prompt = ids[0, :8]
    with torch.no_grad():
        greedy = reference.generate(prompt[None], max_new_tokens=6, do_sample=False,
                                    min_new_tokens=6)[0, 8:].tolist()
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=32))
    (output,) = engine.generate([prompt.tolist()], SamplingParams(max_tokens=6, temperature=0,
                                                                  ignore_eos=True))
    assert output.outputs[0].token_ids == greedy


def test_lathes_fp8_export_is_the_librarys_fp8_dynamic_byte_for_byte(tmp_path):
    """`lathe export --format quantized --quantize fp8` of a model writes the tensors and
    scheme compressed-tensors writes for FP8_DYNAMIC of the same model; `--quantize fp8` at
    load serves exactly what the export serves."""
    from safetensors.torch import load_file
    library = fp8_by_the_library(tmp_path / "library")
    source = tmp_path / "full"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
    model.save_pretrained(source)
    with_tokenizer(source)
    out = save_quantized_checkpoint(source, tmp_path / "lathe", "fp8")
    theirs, ours = load_file(library / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert tensor.dtype == ours[name].dtype and torch.equal(
            tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor,
            ours[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn
            else ours[name]), name
    group = json.loads((out / "config.json").read_text())["quantization_config"]
    assert group["format"] == "float-quantized"
    assert group["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_serving_model(source, quantize="fp8", device="cpu")(ids)
                                   .logits, load_serving_model(out, device="cpu")(ids).logits,
                                   rtol=0, atol=0)


def test_a_mixture_of_experts_serves_fp8_per_expert(tmp_path):
    """A Qwen3-MoE's experts become one FP8 linear per expert and projection, written in
    the per-expert layout and read back to the same values; the router stays full
    precision; an expert computes the reference FP8 product, and the model stays within
    float8's rounding of the full-precision one."""
    from lathe.kernels.fp8_matmul import fp8_matmul_reference
    from lathe.serve.quant import QuantizedExperts
    config = transformers.Qwen3MoeConfig(**SHAPE, moe_intermediate_size=64, num_experts=4,
                                         num_experts_per_tok=2, decoder_sparse_step=1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "full")
    with_tokenizer(tmp_path / "full")
    out = save_quantized_checkpoint(tmp_path / "full", tmp_path / "fp8", "fp8")
    ours = load_serving_model(out, device="cpu")
    at_load = load_serving_model(tmp_path / "full", quantize="fp8", device="cpu")
    experts = ours.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and isinstance(experts.down[3], Fp8Linear)
    assert type(ours.model.layers[0].mlp.gate) is not Fp8Linear
    for a, b in zip(ours.buffers(), at_load.buffers(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
    x = torch.randn(5, 64)
    torch.testing.assert_close(experts.down[3](x), fp8_matmul_reference(
        x, experts.down[3].weight, experts.down[3].scale), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = load_checkpoint(tmp_path / "full")(ids).logits
        got = ours(ids).logits
    assert (got - full).abs().max() / full.abs().max() < 0.15  # float8's rounding, no more


def test_an_fp8_kv_cache_scheme_is_served_in_the_activations_dtype(tmp_path):
    """A checkpoint calibrated for an FP8 KV cache (`kv_cache_scheme`, each attention's
    `k_scale` and `v_scale`) serves as the same checkpoint without it: the cache keeps the
    activations' dtype, the scales are not weights."""
    from safetensors.torch import load_file, save_file
    folder = fp8_by_the_library(tmp_path / "fp8")
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = load_serving_model(folder, device="cpu")(ids).logits
    state = load_file(folder / "model.safetensors")
    for layer in range(SHAPE["num_hidden_layers"]):
        for kind in ("k_scale", "v_scale"):
            state[f"model.layers.{layer}.self_attn.{kind}"] = torch.tensor(0.05)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        torch.testing.assert_close(load_serving_model(folder, device="cpu")(ids).logits,
                                   expected, rtol=0, atol=0)
        load_checkpoint(folder)  # and trains from the weights


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8", "FP8_BLOCK"])
def test_fp8_checkpoints_train_from_the_weights_transformers_decompresses(tmp_path, preset):
    """Training, merging and exporting read an FP8 checkpoint back to full precision as
    transformers decompresses it (`run_compressed=False`): each float8 weight times its
    row's, tensor's or block's scale, the static input scales dropped; the logits are that
    model's."""
    weights = {"FP8_DYNAMIC": FP8_WEIGHTS["channel"], "FP8": FP8_WEIGHTS["tensor"],
               "FP8_BLOCK": {**FP8_WEIGHTS["channel"], "strategy": "block",
                             "block_structure": [32, 32]}}[preset]
    activations = {"FP8_DYNAMIC": FP8_TOKENS, "FP8_BLOCK": {**FP8_TOKENS, "strategy": "group",
                                                            "group_size": 32},
                   "FP8": {**FP8_TOKENS, "strategy": "tensor", "dynamic": False}}[preset]
    folder = compressed_by_the_library(tmp_path / "fp8", weights, fmt="float-quantized",
                                       activations=activations)
    reference = decompressed(folder)
    ours = load_checkpoint(folder, dtype=torch.float32)
    theirs = dict(linears(reference))
    for name, linear in linears(ours):
        torch.testing.assert_close(linear.weight, theirs[name].weight, rtol=0, atol=0,
                                   msg=name)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize(("change", "field"), [
    ({"input_activations": {**FP8_TOKENS, "strategy": "tensor", "dynamic": False}},
     "input_activations"),
    ({"input_activations": None}, "input_activations"),
    ({"weights": {**FP8_WEIGHTS["channel"], "strategy": "block",
                  "block_structure": [128, 128]}}, "weights"),
    ({"weights": {**FP8_WEIGHTS["channel"], "num_bits": 4}}, "weights"),
])
def test_fp8_schemes_lathe_does_not_compute_are_refused_by_field(tmp_path, change, field):
    """Static input scales, weight-only FP8, FP8 blocks and FP4 are refused before a weight
    is read, naming the field."""
    folder = fp8_by_the_library(tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config_groups\.group_0\.{field}="):
        load_serving_model(folder, device="cpu")
