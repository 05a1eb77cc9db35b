"""An FP8 block-quantized checkpoint (transformers' `quant_method: "fp8"`, as Qwen3's
official FP8 releases ship) loads in lathe as transformers loads it without an FP8 GPU:
each weight read back through its block scales. The logits and greedy tokens match
transformers' on the same folder; ragged edge blocks keep their own scales; a scale that
does not tile its weight is refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from lathe.core.errors import CheckpointError
from lathe.model import load_checkpoint

BLOCK = [32, 32]  # Qwen3's are 128×128; small ones here, so the tiny model has several
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` as float8 e4m3 and its per-block `weight_scale_inv`, as the FP8 releases
    are made: each block's largest magnitude maps to float8's largest (448)."""
    rows, columns = weight.shape
    grid = (math.ceil(rows / BLOCK[0]), math.ceil(columns / BLOCK[1]))
    scale = torch.empty(grid)
    quantized = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            cut = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            scale[i, j] = weight[cut].abs().max().clamp(min=1e-12) / 448.0
            quantized[cut] = (weight[cut] / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def fp8_folder(folder, hidden: int, intermediate: int):
    """A tiny Qwen3 saved by transformers, its linears block-quantized to FP8; and its
    weights before."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    original = dict(state)
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED]:
        state[name], state[name + "_scale_inv"] = block_quantized(state[name])
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic", "weight_block_size": BLOCK}
    (folder / "config.json").write_text(json.dumps(hf))
    return folder, original


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """Every dimension a multiple of the block, as in Qwen3's FP8 releases."""
    return fp8_folder(tmp_path_factory.mktemp("fp8"), 64, 96)[0]


def test_an_fp8_checkpoint_gives_transformers_logits(fp8_checkpoint):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    model = load_checkpoint(fp8_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids).logits
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # not the float8 values themselves: the scales were applied
    state = load_file(fp8_checkpoint / "model.safetensors")
    raw = state["model.layers.0.self_attn.q_proj.weight"].float()
    read = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(read, raw) and read.abs().max() < raw.abs().max()


def test_an_fp8_checkpoint_serves_greedy_as_transformers_generates(fp8_checkpoint):
    from transformers import AutoModelForCausalLM

    from lathe.serve.engine import LLMEngine
    from lathe.serve.quant import load_serving_model
    from lathe.serve.sampling_params import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.float32).eval()
    prompt = [5, 17, 33, 2, 90, 41]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    engine = LLMEngine(load_serving_model(fp8_checkpoint, device="cpu"), None, eos_token_ids=[])
    [done] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert done.outputs[0].token_ids == expected


def test_ragged_edge_blocks_are_read_by_their_own_scales(tmp_path):
    """72 and 40 are not multiples of 32: the last blocks of a row or column are cut at the
    weight's edge and keep their own scale (DeepSeek-V3's `kv_a_proj_with_mqa`, 576 rows, is
    such a weight). transformers 5.24 reads such a checkpoint with blocks of 24 columns
    instead, so the reference here is the block loop that wrote it."""
    folder, original = fp8_folder(tmp_path / "ragged", 72, 40)
    state = load_file(folder / "model.safetensors")
    model = load_checkpoint(folder, dtype=torch.float32)
    half = load_checkpoint(folder, dtype=torch.bfloat16)
    for layer, (module, name) in enumerate([("self_attn", "q_proj"), ("mlp", "down_proj")]):
        key = f"model.layers.{layer}.{module}.{name}.weight"
        quantized, scale = state[key].float(), state[key + "_scale_inv"]
        expected = torch.empty_like(quantized)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                cut = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]),
                       slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
                expected[cut] = quantized[cut] * scale[i, j]
        read = getattr(getattr(model.model.layers[layer], module), name).weight
        assert torch.equal(read, expected)
        # read straight into bf16, the GPU's dtype: the float32 product rounded once
        bf16 = getattr(getattr(half.model.layers[layer], module), name).weight
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, expected.to(torch.bfloat16))
        # within float8's rounding of each block (3 mantissa bits: half a step is 1/16)
        assert ((read - original[key]).abs() <= original[key].abs() / 16 + 1e-6).all()


def test_a_scale_that_does_not_tile_its_weight_is_refused_by_name(fp8_checkpoint, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(fp8_checkpoint, folder)
    state = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    state[name] = state[name][:, :1].contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name.removesuffix('_scale_inv')} .* scales"):
        load_checkpoint(folder)
    hf = json.loads((folder / "config.json").read_text())
    hf["quantization_config"]["weight_block_size"] = None
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="weight_block_size=None"):
        load_checkpoint(folder)


def test_stacked_experts_read_as_each_expert_alone():
    """A fused expert tensor (experts, rows, columns) with its scales (experts, ...) reads
    as each of its experts would alone."""
    from pathlib import Path

    from lathe.model.fp8_weights import Fp8Format, dequantize_fp8

    torch.manual_seed(0)
    experts = [block_quantized(torch.randn(40, 72)) for _ in range(3)]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    stacked = dequantize_fp8({name: torch.stack([w for w, _ in experts]),
                              name + "_scale_inv": torch.stack([s for _, s in experts])},
                             Fp8Format("_scale_inv", tuple(BLOCK)), torch.float32, Path("x"))
    for index, (weight, scale) in enumerate(experts):
        alone = dequantize_fp8({"w": weight, "w_scale_inv": scale},
                               Fp8Format("_scale_inv", tuple(BLOCK)), torch.float32,
                               Path("x"))["w"]
        assert torch.equal(stacked[name][index], alone)
