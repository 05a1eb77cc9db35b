"""Open-model families, each a tiny random model that transformers' own config class builds
and `save_pretrained` writes: lathe loads it with transformers' logits, exports it as the
same class with the same logits, and the serve engine's greedy tokens are transformers'.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from lathe.model import load_checkpoint, save_checkpoint
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.paged_cache import KVSlabs
from lathe.serve.sampling_params import SamplingParams
from tests import llama_cpp_runtime

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
GEMMA4 = {"head_dim": 16, "global_head_dim": 32, "sliding_window": 12,
          "hidden_size_per_layer_input": 0, "pad_token_id": 0, "bos_token_id": 2,
          "eos_token_id": 1}
FAMILIES = {
    "llama-attention-bias": ("LlamaConfig", {"attention_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # head_dim x heads != hidden_size
    "qwen3-bias": ("Qwen3Config", {"head_dim": 16, "attention_bias": True}),
    # SmolLM3's special ids default to its 128k vocabulary's
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0], "pad_token_id": 0,  # NoPE in 1
                                  "bos_token_id": 1, "eos_token_id": 2}),
    "smollm3-default": ("SmolLM3Config", {"num_hidden_layers": 4, "attention_bias": True,
                                          "pad_token_id": 0, "bos_token_id": 1,
                                          "eos_token_id": 2}),
    # sliding windows shorter than the prompts: every layer (Mistral v0.1), the layers from
    # max_window_layers on (Qwen), the layers without RoPE (SmolLM3)
    "mistral-window": ("MistralConfig", {"sliding_window": 12}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 12,
                                     "max_window_layers": 1}),
    "qwen3-window": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 20,
                                     "max_window_layers": 0}),
    "smollm3-window": ("SmolLM3Config", {"no_rope_layers": [1, 0], "use_sliding_window": True,
                                         "sliding_window": 12, "pad_token_id": 0,
                                         "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma 2: (1 + w) norms around attention and MLP, GeGLU, embeddings x sqrt(dim),
    # soft-capped scores and logits, a query scale apart from head_dim, every other layer
    # sliding; Gemma 3: no caps, q/k norms, its sliding layers' own RoPE base
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                "sliding_window": 12, "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 20.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                    "sliding_window": 12,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1000000.0}}}),
    # Gemma 4 (31B's shape): full layers with heads of their own width and KV heads, whose
    # values are their keys' projection, turned by proportional RoPE (a quarter of each
    # half-head); v normed; each layer's output scaled by its own stored scalar; logits capped
    "gemma4": ("Gemma4TextConfig", {**GEMMA4, "num_hidden_layers": 4, "global_head_dim": 32,
                                    "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                                    "final_logit_softcapping": 20.0}),
    # and with a v_proj in every layer and plain RoPE on the full ones
    "gemma4-plain": ("Gemma4TextConfig", {**GEMMA4, "layer_types": ["sliding_attention",
                                                                   "full_attention"],
                                          "rope_parameters": {
                                              "sliding_attention": {"rope_type": "default",
                                                                    "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "default",
                                                                 "rope_theta": 50000.0}}}),
    # Gemma 4 E2B/E4B: each layer's own input (per-layer embeddings) gating a branch after its
    # MLP; the last two layers attend over the keys and values of the last earlier layer of
    # their kind (sliding, full), with MLPs twice as wide
    "gemma4-e2b": ("Gemma4TextConfig", {**GEMMA4, "num_hidden_layers": 6,
                                        "layer_types": ["sliding_attention", "full_attention"] * 3,
                                        "hidden_size_per_layer_input": 8,
                                        "vocab_size_per_layer_input": 256,
                                        "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
                                        "final_logit_softcapping": 20.0}),
    # Gemma 4 26B-A4B: experts beside each layer's MLP, routed from the layer's residual
    # through the router's own scaled norm, each chosen expert's weight scaled by its own
    # factor, the MLP's and the experts' outputs normed apart before their sum is
    "gemma4-moe": ("Gemma4TextConfig", {**GEMMA4, "layer_types": ["sliding_attention",
                                                                 "full_attention"],
                                        "enable_moe_block": True, "num_experts": 4,
                                        "top_k_experts": 2, "moe_intermediate_size": 32,
                                        "final_logit_softcapping": 20.0}),
    # Phi-3: q/k/v and gate/up stored fused; Phi-4-mini's partial rotary; Phi-3-mini's window
    "phi3": ("Phi3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5},
                            "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    "phi3-window": ("Phi3Config", {"sliding_window": 12, "pad_token_id": 0, "eos_token_id": 2,
                                   "bos_token_id": 1}),
    # mixtures of experts: every layer (Mixtral), a dense layer among them and experts of
    # their own width (Qwen3-MoE), whole-projection q/k norms and clipped q, k, v (OLMoE)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                     "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 3.0,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # OLMo 2: norms after attention and the MLP only, q/k normed over whole projections;
    # OLMo 3: its sliding layers (a window shorter than the prompts) rotate with their own,
    # unscaled RoPE while its full ones are YaRN-scaled
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1,
                              "eos_token_id": 2}),
    "olmo3": ("Olmo3Config", {"num_hidden_layers": 4, "sliding_window": 12, "pad_token_id": 0,
                              "bos_token_id": 1, "eos_token_id": 2, "rope_parameters": {
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64,
                                                     "rope_theta": 50000.0}}}),
    "olmo3-alternating": ("Olmo3Config", {"sliding_window": 12, "pad_token_id": 0,
                                          "layer_types": ["sliding_attention",
                                                          "full_attention"]}),
    # Qwen1.5-MoE: a shared expert with its sigmoid gate beside the routed ones
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48}),
    # GLM-4.5: DeepSeek-V3's router (sigmoid scores, a selection bias, the best 2 of 4 groups
    # of experts, scaled weights), an ungated shared expert, a dense first layer, half of
    # each head rotated, q/k norms and q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 16, "n_routed_experts": 8,
                                   "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                   "n_shared_experts": 2, "first_k_dense_replace": 1,
                                   "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                   "use_qk_norm": True, "attention_bias": True,
                                   "num_hidden_layers": 3, "pad_token_id": 0,
                                   "bos_token_id": 1, "eos_token_id": 2}),
}
SEQ = 96


def hf_model(name: str):
    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random weights attend almost uniformly and give near-equal
        model.lm_head.weight.mul_(30)  # logits: sharpen both, and give the biases values
        for layer in model.model.layers:
            attention = layer.self_attn
            if hasattr(attention, "qkv_proj"):  # Phi-3: q and k are its first rows
                kv = config.num_key_value_heads * attention.head_dim
                attention.qkv_proj.weight[:-kv].mul_(8)
                continue
            attention.q_proj.weight.mul_(8)
            if hasattr(attention, "k_proj"):  # not a Gemma 4 layer sharing another's keys
                attention.k_proj.weight.mul_(8)
            for proj in (attention.q_proj, getattr(attention, "k_proj", None),
                         getattr(attention, "v_proj", None), attention.o_proj):
                if proj is not None and proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            for norm in (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)):
                if norm is not None:
                    norm.weight.normal_(1, 0.3)
            if hasattr(layer, "layer_scalar"):  # Gemma 4's, trained away from 1
                layer.layer_scalar.uniform_(0.5, 1.5)
            router = getattr(layer.mlp, "gate", None)
            if router is not None:  # decisive routing: no near-tie between two experts
                router.weight.normal_(0, 1)
                bias = getattr(router, "e_score_correction_bias", None)
                if bias is not None:  # a selection bias that changes the choice
                    bias.normal_(0, 0.3)
            if hasattr(layer, "router"):  # Gemma 4's, beside the MLP: its scales and norms
                layer.router.proj.weight.normal_(0, 1)
                layer.router.scale.normal_(1, 0.3)
                layer.router.per_expert_scale.uniform_(0.5, 1.5)
                for norm in (layer.post_feedforward_layernorm_1,
                             layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_2):
                    norm.weight.normal_(1, 0.3)
    return model


def saved(name: str, folder):
    """`hf_model(name)`, written to `folder` by its `save_pretrained`."""
    hf = hf_model(name)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("name", FAMILIES)
def test_load_and_export_as_the_same_model_with_the_same_logits(tmp_path, name):
    hf = saved(name, tmp_path / "hf")
    ids = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        expected = hf(ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours(ids).logits - expected).abs().max() <= 1e-4
    save_checkpoint(ours, tmp_path / "lathe")
    written = json.loads((tmp_path / "lathe" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    assert written["architectures"] == [type(hf).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again) is type(hf)
    assert set(again.state_dict()) == set(hf.state_dict())
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4


# multimodal checkpoints of a family's language model, each with a tiny vision tower: the
# wrapper's config class, its text config class, the tower's, and the text model's class
MULTIMODAL = {
    "gemma3": ("Gemma3Config", "Gemma3TextConfig", "Gemma3ForConditionalGeneration",
               "Gemma3ForCausalLM", transformers.SiglipVisionConfig(
                   hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=7),
               {"mm_tokens_per_image": 4, "boi_token_index": 297, "eoi_token_index": 298,
                "image_token_index": 299}),
    "mistral3": ("Mistral3Config", "MistralConfig", "Mistral3ForConditionalGeneration",
                 "MistralForCausalLM", transformers.PixtralVisionConfig(
                     hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, image_size=28, patch_size=14, head_dim=16),
                 {"image_token_index": 299}),
}


def with_vision(kind: str, folder, text: dict):
    """A `kind` multimodal checkpoint (`MULTIMODAL`), its language model sharpened as
    `hf_model`'s, written by `save_pretrained` with its text_config left sparse, as
    transformers 4.x writes a nested config (the difference from the wrapper's default
    text config) and the hub's checkpoints hold it."""
    wrapper, text_class, model_class, _, vision, extra = MULTIMODAL[kind]
    config = getattr(transformers, wrapper)(
        text_config=getattr(transformers, text_class)(**text).to_dict(),
        vision_config=vision.to_dict(), **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    language = model.model.language_model
    with torch.no_grad():
        language.embed_tokens.weight.mul_(30)
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(30)
        for layer in language.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
            for norm in (getattr(layer.self_attn, "q_norm", None),
                         getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.normal_(1, 0.3)
    model.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    default = getattr(transformers, wrapper)().text_config.to_dict()
    sparse = {key: value for key, value in written["text_config"].items()
              if key == "model_type" or value != default.get(key)}
    (folder / "config.json").write_text(json.dumps({**written, "text_config": sparse}))
    return model


@pytest.mark.parametrize(("kind", "text", "defaults"), [
    # 8 heads of 256, GELU, a tied head, ...: Gemma3TextConfig's
    ("gemma3", {"sliding_window": 12},
     {"n_heads": 8, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh"}),
    # Mistral Small 3.1's: 32 heads of 128 (MistralConfig would make 2 of 64 / 32), RoPE
    # base 1e9, no window
    ("mistral3", {"head_dim": 128, "sliding_window": None,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}},
     {"n_heads": 32, "head_dim": 128, "rope_theta": 1e9, "sliding_window": None}),
])
def test_a_multimodal_checkpoint_loads_and_exports_as_its_language_model(tmp_path, kind, text,
                                                                         defaults):
    """Gemma 3 from 4B up and Mistral Small 3.x are multimodal checkpoints: the language
    model's text_config (every key it leaves out the wrapper's default), its weights under
    language_model.model. beside the vision tower's. lathe loads the language model with
    transformers' text logits, exports it as the text model's class with the same logits,
    keeps the processor's chat template, and its engine's greedy tokens are transformers';
    its GGUF file gives llama.cpp the same logits."""
    hf = with_vision(kind, tmp_path / "hf", {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "max_position_embeddings": 512, **text})
    sparse = json.loads((tmp_path / "hf" / "config.json").read_text())["text_config"]
    assert not {"num_attention_heads", "head_dim"} & set(sparse)
    ids = torch.randint(0, 296, (2, SEQ))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert {key: getattr(ours.config, key) for key in defaults} == defaults
        assert (ours(ids).logits - expected).abs().max() <= 1e-4
    # its template where the processor keeps it; the text model's export keeps it as its own
    template = "{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}"
    tokenizer_config = with_tokenizer(tmp_path / "hf") / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({key: value for key, value in fields.items()
                                            if key != "chat_template"}))
    (tmp_path / "hf" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    save_checkpoint(ours, tmp_path / "lathe", tokenizer=tmp_path / "hf")
    assert (tmp_path / "lathe" / "chat_template.jinja").read_text() == template
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == MULTIMODAL[kind][3]
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4
    prompt = ids[0, :20].tolist()
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=64))
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                         ignore_eos=True))
    assert output.outputs[0].token_ids == greedy(again, prompt, 16)
    # and its GGUF is the language model's in llama.cpp (Gemma's GELU there reads f16s)
    from lathe.serve.gguf_export import export_gguf
    out = export_gguf(tmp_path / "hf", tmp_path / "m.gguf", dtype="f32")
    theirs = llama_cpp_runtime.LlamaCpp(out, 64).logits(prompt)
    error = (theirs - expected[0, :20]).abs().max() / expected[0, :20].abs().max()
    assert error < (1e-3 if kind == "gemma3" else 1e-5)


def test_gemma4_instruct_checkpoint_loads_as_its_language_model(tmp_path):
    """Gemma 4 ships as Gemma4ForConditionalGeneration (31B-it's shape: wider full layers
    whose keys are their values): lathe loads its language model with transformers' logits,
    leaving the image tower and its embedder out, exports it as Gemma4ForCausalLM, and its
    engine's greedy tokens are transformers'."""
    text = transformers.Gemma4TextConfig(**{
        **GEMMA4, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "final_logit_softcapping": 30.0, "layer_types": ["sliding_attention", "full_attention"]})
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)).eval()
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(30)
        for layer in hf.model.language_model.layers:
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.layer_scalar.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 296, (2, SEQ))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours.config.global_head_dim, ours.config.global_k_is_v) == (32, True)
        assert (ours(ids).logits - expected).abs().max() <= 1e-4
    save_checkpoint(ours, tmp_path / "lathe")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == "Gemma4ForCausalLM"
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4
    prompt = ids[0, :20].tolist()
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=64))
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                         ignore_eos=True))
    assert output.outputs[0].token_ids == greedy(again, prompt, 16)


@pytest.mark.parametrize(("changes", "message"), [
    ({"enable_moe_block": True, "num_experts": None}, "enable_moe_block=true needs num_experts"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'.*causal"),
    # a per-layer table of another vocabulary than the model's
    ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512},
     "vocab_size_per_layer_input=512.*vocab_size=256"),
    # every layer sharing: none left to compute the keys and values
    ({"num_kv_shared_layers": 2}, "kv_shared_layers=2: at least one"),
    # the shared layer is full, and no earlier layer is
    ({"num_kv_shared_layers": 1, "layer_types": ["sliding_attention", "full_attention"]},
     "must each have an earlier layer of that kind"),
])
def test_the_gemma4_shapes_lathe_does_not_build_are_refused_by_name(changes, message):
    from lathe.core.errors import ConfigError
    from lathe.model.config import ModelConfig
    text = transformers.Gemma4TextConfig(**{**SHAPE, **GEMMA4, "num_hidden_layers": 2}).to_dict()
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config({**text, **changes})


def test_a_gemma4_checkpoint_holding_its_shared_layers_keys_loads_without_them(tmp_path):
    """A Gemma 4 E2B/E4B checkpoint may hold k/v weights for its KV-sharing layers, which
    transformers ignores: lathe loads it alike, and exports without them."""
    from safetensors.torch import load_file, save_file
    hf = saved("gemma4-e2b", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    state = load_file(weights)
    for layer in (4, 5):
        for part, shape in (("k_proj", (32, 64)), ("v_proj", (32, 64)), ("k_norm", (16,))):
            state[f"model.layers.{layer}.self_attn.{part}.weight"] = torch.randn(shape)
    save_file(state, weights, metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4
    save_checkpoint(ours, tmp_path / "lathe")
    written = load_file(tmp_path / "lathe" / "model.safetensors")
    assert not [name for name in written if name.startswith("model.layers.4.self_attn.k")]


def test_a_gemma4_moe_adapter_loads_in_peft_on_its_class_and_back(tmp_path):
    """26B-A4B keeps its experts beside the MLP at the layer's level (`layers.N.experts`),
    lathe inside its MoE block: an adapter on attention and the stacked experts is written
    under the class's names, so peft on `Gemma4ForCausalLM` computes lathe's adapted logits,
    and lathe reads it back; the engine's slots refuse it as the experts' adapter it is, and
    serve one that peft put on the class's MLP beside the experts (lathe's shared expert) as
    peft computes it, and lathe loads that one as peft does."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from lathe.core.errors import CheckpointError
    from lathe.model.lora import LoraSection, apply_lora, load_adapter, save_adapter
    saved("gemma4-moe", tmp_path / "hf")
    section = LoraSection(enabled=True, r=4, target_modules=["q_proj", "gate_proj", "down_proj"])
    model = apply_lora(load_checkpoint(tmp_path / "hf"), section)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    save_adapter(model, section, tmp_path / "adapter", tmp_path / "hf")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".layers.0.experts.lora_A" in name for name in written)
    assert not any(".mlp.experts." in name for name in written)
    ids = torch.randint(0, 256, (2, SEQ))
    theirs = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = model(ids).logits
        assert (ours - load_checkpoint(tmp_path / "hf")(ids).logits).abs().max() > 1e-2
        assert (theirs(ids).logits - ours).abs().max() <= 1e-4
        reloaded = load_adapter(load_checkpoint(tmp_path / "hf"), tmp_path / "adapter")
        assert (reloaded(ids).logits - ours).abs().max() <= 1e-5
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=32, max_loras=1))
    with pytest.raises(CheckpointError, match="adapts a mixture of experts' stacked experts"):
        engine.add_adapter("experts", tmp_path / "adapter")

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                             dtype=torch.float32)
    dense = get_peft_model(base, LoraConfig(r=4, target_modules=["gate_proj", "o_proj"],
                                            init_lora_weights=False)).eval()
    dense.save_pretrained(tmp_path / "dense")
    engine.add_adapter("dense", tmp_path / "dense")
    prompt = ids[0, :20].tolist()
    adapted = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True), adapter="dense")
    assert adapted[0].outputs[0].token_ids == greedy(dense, prompt, 6)
    with torch.no_grad():  # and lathe's own load of it (a merge, a resumed run) is peft's
        loaded = load_adapter(load_checkpoint(tmp_path / "hf"), tmp_path / "dense")
        assert (loaded(ids).logits - dense(ids).logits).abs().max() <= 1e-4


def test_gemma4_full_layers_read_alike_from_the_hub_form_and_per_layer_config():
    """The hub's Gemma 4 configs name the full layers' shape `global_head_dim` and
    `num_global_key_value_heads`; transformers 5.24 writes `per_layer_config` instead. Both
    read as one ModelConfig; a per-layer shape lathe cannot hold is refused by layer."""
    from lathe.core.errors import ConfigError
    from lathe.model.config import ModelConfig
    config = transformers.Gemma4TextConfig(**{**SHAPE, **GEMMA4, "num_hidden_layers": 2,
                                              "layer_types": ["sliding_attention",
                                                              "full_attention"],
                                              "num_global_key_value_heads": 1,
                                              "attention_k_eq_v": True}).to_dict()
    assert config["per_layer_config"] == {"1": {"head_dim": 32, "num_key_value_heads": 1}}
    hub = {key: value for key, value in config.items() if key != "per_layer_config"}
    hub.update(global_head_dim=32, num_global_key_value_heads=1)
    assert ModelConfig.from_hf_config(config) == ModelConfig.from_hf_config(hub)
    assert ModelConfig.from_hf_config(hub).attention_shape(1) == (1, 32)
    hub.pop("global_head_dim")  # transformers' default: 512
    assert ModelConfig.from_hf_config(hub).attention_shape(1) == (1, 512)
    with pytest.raises(ConfigError, match=r"per_layer_config\[0\]"):
        ModelConfig.from_hf_config({**config, "per_layer_config": {
            "0": {"head_dim": 8}, "1": {"head_dim": 32}}})


def test_a_peft_adapter_of_a_multimodal_gemma3_serves_over_its_language_model(tmp_path):
    """peft names a wrapper's projections by its module path (language_model..., and the
    vision tower's q_proj too when a target matches them): the served adapter is the
    language model's part, with the merged model's greedy tokens."""
    peft = pytest.importorskip("peft")
    hf = with_vision("gemma3", tmp_path / "hf", {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "sliding_window": 12, "max_position_embeddings": 512})
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    assert any("vision_tower" in name and "lora_" in name
               for name, _ in adapted.named_parameters())
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload().eval()
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_loras=1, max_lora_rank=8))
    engine.add_adapter("a", tmp_path / "adapter")
    prompt = torch.randint(0, 296, (20,)).tolist()
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True), adapter="a")
    assert output.outputs[0].token_ids == greedy(merged, prompt, 12)


def test_a_peft_adapter_of_gemma4_serves_across_its_two_head_widths(tmp_path):
    """A LoRA adapter on Gemma 4's q, k, v and o: its full layers' adapters are wider and
    have no v_proj to adapt; the served adapter gives the merged model's greedy tokens."""
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(saved("gemma4", tmp_path / "hf"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    merged = adapted.merge_and_unload().eval()
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_loras=1, max_lora_rank=8))
    engine.add_adapter("a", tmp_path / "adapter")
    prompt = torch.randint(0, 256, (20,)).tolist()
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True), adapter="a")
    assert output.outputs[0].token_ids == greedy(merged, prompt, 12)


def test_a_multimodal_config_without_its_text_config_is_refused_by_name(tmp_path):
    from lathe.core.errors import CheckpointError
    from lathe.model.checkpoint import read_model_config
    tmp_path.joinpath("config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(CheckpointError, match="model_type='gemma3' needs its language "
                                              "model's settings as an object in text_config"):
        read_model_config(tmp_path)
    tmp_path.joinpath("config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(CheckpointError, match="lathe loads llama, .*the language model of "
                                              "gemma3"):
        read_model_config(tmp_path)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama-attention-bias", "mistral-window",
                                  "gemma2", "gemma3", "phi3", "qwen3_moe", "olmoe", "glm4_moe",
                                  "olmo2", "gemma4", "gemma4-e2b", "gemma4-moe"])
def test_bf16_autocast_stays_close(tmp_path, name):
    """Within 3% of the fp32 logits, or where transformers' own bf16 strays further (Gemma 4
    scales no scores, so its sharpened random model's bf16 logits move ~10%), within 1.5x of
    its stray."""
    hf = saved(name, tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        expected = hf(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = load_checkpoint(tmp_path / "hf")(ids).logits.float()
            theirs = hf(ids).logits.float()
    allowed = max(3e-2 * expected.abs().max(), 1.5 * (theirs - expected).abs().max())
    assert (ours - expected).abs().max() <= allowed


def greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward over the sequence so far:
    `generate` with its KV cache rounds differently from the full forward, enough to flip
    a random model's near-ties (0.433 against 0.427 once here) that lathe computes as the
    full forward does."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "smollm3", "mistral-window",
                                  "qwen2-window", "gemma2", "gemma3", "phi3", "phi3-window",
                                  "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe",
                                  "olmo2", "olmo3", "gemma4", "gemma4-e2b", "gemma4-moe"])
def test_the_engine_generates_what_transformers_computes(tmp_path, name):
    hf = saved(name, tmp_path / "hf")
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 40, 70)]
    prompts.append(prompts[1][:30] + [7, 8, 9])  # shares a cached prefix with prompt 1
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_num_batched_tokens=32))  # long prompts prefill in chunks
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                      ignore_eos=True, n=2))
    assert engine.block_manager.prefix_hits > 0
    slabs = engine.runner.slabs  # the KV-sharing layers' slabs are their sources', not more
    assert slabs.nbytes == 65 * KVSlabs.bytes_per_block(engine.runner.model.config,
                                                        slabs.block_size, slabs.k[0].dtype)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == output.outputs[1].token_ids == \
            greedy(hf, prompt, 32)


@pytest.mark.parametrize("name", ["glm4_moe", "olmo3", "gemma4-e2b"])
def test_compiled_decode_steps_keep_the_family(tmp_path, name):
    """`lathe serve`'s default compiled decode steps compute transformers' tokens: through
    a biased, grouped sigmoid router, past OLMo 3's and Gemma 4's sliding windows (a
    window on every layer, Mistral's, is the same masked step), through OLMo 3's norms
    after attention and the MLP, its sliding layers' own RoPE and its full ones' YaRN,
    and through Gemma 4's layers of two head widths (KV slabs of two shapes), E2B's last ones
    attending over earlier layers' slabs."""
    hf = saved(name, tmp_path / "hf")
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 40)]
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=64,
                                                                     compile_decode=True))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                      ignore_eos=True))
    assert engine.runner.graphs.steps > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == greedy(hf, prompt, 24)


@pytest.mark.parametrize("name", ["qwen2", "qwen3-bias"])
def test_quantized_linears_keep_their_biases(tmp_path, name):
    from lathe.serve.quant import load_serving_model
    hf = saved(name, tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 48))
    with torch.no_grad():
        expected = hf(ids).logits
        for mode in ("int8", "int4"):
            ours = load_serving_model(tmp_path / "hf", quantize=mode)(ids).logits
            error = (ours - expected).abs().mean() / expected.abs().mean()
            assert error < (0.03 if mode == "int8" else 0.15), (mode, float(error))


def with_tokenizer(folder, vocab_size: int = 300):
    """A byte-level BPE tokenizer (lathe's) copied into a transformers-written folder."""
    from lathe.data.tokenizer import save_tokenizer, train_tokenizer
    tokenizer = train_tokenizer(["the cat sat on the mat, 12 + 34"] * 20, vocab_size=vocab_size,
                                show_progress=False)
    save_tokenizer(tokenizer, folder.parent / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((folder.parent / "tokenizer" / name).read_bytes())
    return folder


# the families llama.cpp has an architecture for, as its converter writes them (real Gemma
# checkpoints tie their head and scale queries by head_dim, as llama.cpp's graph assumes)
GGUF_FAMILIES = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                "sliding_window": 12, "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 20.0, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                    "sliding_window": 12}),
    "phi3": ("Phi3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                              "num_key_value_heads": 4}),  # llama.cpp's olmoe: no GQA
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48}),
    "glm4_moe": FAMILIES["glm4_moe"],
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2}),
    "olmo3": ("Olmo3Config", {"num_hidden_layers": 4, "sliding_window": 12}),
    # OLMo 3's long-context form: YaRN on the full layers only
    "olmo3-yarn": ("Olmo3Config", {"num_hidden_layers": 4, "sliding_window": 12,
                                   "max_position_embeddings": 64, "rope_parameters": {
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 50000.0},
                                       "full_attention": {
                                           "rope_type": "yarn", "factor": 4.0, "truncate": True,
                                           "original_max_position_embeddings": 16,
                                           "rope_theta": 50000.0}}}),
    "gemma4": ("Gemma4TextConfig", {**GEMMA4, "num_hidden_layers": 4, "tie_word_embeddings": True,
                                    "final_logit_softcapping": 20.0,
                                    "num_global_key_value_heads": 1, "attention_k_eq_v": True}),
    "gemma4-e2b": ("Gemma4TextConfig", {**FAMILIES["gemma4-e2b"][1],
                                        "vocab_size_per_layer_input": 512}),
    "gemma4-moe": FAMILIES["gemma4-moe"],
    "glm4_moe-ungrouped": ("Glm4MoeConfig", {**FAMILIES["glm4_moe"][1], "n_group": 1,
                                             "topk_group": 1, "use_qk_norm": False,
                                             "attention_bias": False}),
}


def llama_cpp_error(hf, folder, length: int, n_ctx: int, dtype: str = "f32") -> float:
    """`hf` saved to `folder` with a tokenizer and exported to GGUF (`dtype`): the largest
    difference between llama.cpp's logits (an f32 KV cache, no flash attention) and lathe's
    on `length` tokens, relative to the largest of lathe's — ~1e-6 where the two compute
    the same function."""
    from lathe.serve.gguf_export import export_gguf
    hf.save_pretrained(folder)
    with_tokenizer(folder)
    out = export_gguf(folder, folder.with_suffix(".gguf"), dtype=dtype)
    ids = torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ours = load_checkpoint(folder)(torch.tensor([ids])).logits[0]
    theirs = llama_cpp_runtime.LlamaCpp(out, n_ctx).logits(ids)
    return float((theirs - ours).abs().max() / ours.abs().max())


def sharpened(hf):
    """Matrices × 3, norms ~ N(1, 0.2) and the rest ~ N(0, 0.2): random weights that do not
    attend almost uniformly."""
    with torch.no_grad():
        for parameter_name, parameter in hf.named_parameters():
            if parameter.dim() == 2:
                parameter.mul_(3)
            else:
                parameter.normal_(1 if "norm" in parameter_name else 0, 0.2)
    return hf


def gguf_family_model(name: str):
    """transformers' model of `GGUF_FAMILIES[name]`, seeded, with a 512-token vocabulary."""
    config_class, extra = GGUF_FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, "vocab_size": 512, "pad_token_id": 0,
                                                    "bos_token_id": 1, "eos_token_id": 2, **extra})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_export_of_a_family_gives_llama_cpps_logits(tmp_path, name):
    """The file as llama.cpp's own architecture for the family (NEOX RoPE unpermuted, biases,
    q/k norms, Gemma's 1 + w norms, soft-caps and sliding layers, Phi-3's fused projections
    and partial rotary, GLM-4.5's biased sigmoid router in groups) computes lathe's logits in
    llama.cpp, past the window, to 1e-5 of the largest logit. Gemma's are 3e-4 apart, not a
    wrong weight: ggml's CPU GELU reads a table of f16 values; Gemma 4's 2e-3, its norms near
    1 (not 0) feeding GELU larger values (1.8e-4 with lathe's GELU rounded through f16; a
    wrong RoPE on the full layers is 0.23 off); E2B's 8e-3 over six layers, three of them
    GELU's again (3e-3 with lathe's GELU through f16; its shared layers reading an older
    layer's keys are 0.62 off, its per-layer branch left out 1.25)."""
    llama_cpp_runtime.library()
    hf = gguf_family_model(name)
    with torch.no_grad():
        for parameter_name, parameter in hf.named_parameters():
            if parameter.dim() == 2:
                parameter.mul_(3)
            elif "norm" in parameter_name:  # Gemma's start at 0 (1 + w), the others at 1
                parameter.normal_(0 if name in ("gemma2", "gemma3") else 1, 0.2)
            else:
                parameter.normal_(0, 0.3)
        for buffer_name, buffer in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # GLM-4.5's selection bias
                buffer.normal_(0, 0.3)
    # named after its family: llama.cpp looks up Phi-3's special tokens when the model's
    # name says phi3, which this vocabulary lacks (the export renames it)
    gelu = "gelu" in (getattr(hf.config, "hidden_activation", None) or "")
    tolerance = {"gemma4": 3e-3, "gemma4-e2b": 1e-2}.get(name, 1e-3 if gelu else 1e-5)
    assert llama_cpp_error(hf, tmp_path / f"{name}-tiny", 40, 64) < tolerance


@pytest.mark.parametrize("name", ["qwen3_moe", "phi3"])
def test_a_q8_0_gguf_of_a_family_runs_in_llama_cpp_to_its_rounding(tmp_path, name):
    """q8_0 (blocks of 32) through the tensors lathe's own model lacks — experts stacked in
    three dimensions, Phi-3's fused projections: llama.cpp's logits are lathe's to its
    8-bit rounding of weights and activations (measured 4% and 1.5%; a transposed or
    misordered tensor is ~100% off)."""
    llama_cpp_runtime.library()
    hf = gguf_family_model(name)
    assert llama_cpp_error(hf, tmp_path / f"{name}-tiny", 40, 64, dtype="q8_0") < 0.15


YARN_GGUF = {
    "qwen2": ("Qwen2Config", {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32}),
    "llama": ("LlamaConfig", {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32}),
    "qwen2-mscale": ("Qwen2Config", {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                     "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 32}),
    "qwen3-attention-factor": ("Qwen3Config", {"rope_type": "yarn", "factor": 4.0,
                                               "attention_factor": 1.3,
                                               "original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("name", YARN_GGUF)
def test_gguf_export_of_yarn_gives_llama_cpps_logits_past_the_original_context(tmp_path,
                                                                              name):
    """YaRN as llama.cpp reads it (its type, factor, original context, betas and the
    attention factor beside its own 1 + 0.1 ln(factor)): 100 tokens on a 32-token original
    context compute lathe's (and transformers') logits in llama.cpp."""
    llama_cpp_runtime.library()
    config_class, rope = YARN_GGUF[name]
    config = getattr(transformers, config_class)(**{
        **SHAPE, "vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": rope, "rope_theta": 10000.0})
    torch.manual_seed(0)
    hf = sharpened(transformers.AutoModelForCausalLM.from_config(config).float().eval())
    assert llama_cpp_error(hf, tmp_path / "hf", 100, 128) < 1e-5
    ids = torch.randint(3, 300, (1, 100))
    with torch.no_grad():  # and lathe computes transformers' logits there
        assert (load_checkpoint(tmp_path / "hf")(ids).logits - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize(("partial", "original"), [(1.0, 32), (0.75, 32), (1.0, 512)],
                         ids=["long", "long-partial", "short"])
def test_gguf_export_of_longrope_gives_llama_cpps_logits(tmp_path, partial, original):
    """Phi-3.5 / Phi-4-mini LongRoPE as llama.cpp's phi3 reads it: both factor lists and the
    attention factor. llama.cpp takes the long factors when its context (padded to 256)
    passes the original one, transformers when a forward's positions do: 100 tokens in a
    128-token context agree with lathe both past a 32-token original and within 512."""
    llama_cpp_runtime.library()
    rotated = int(16 * partial) // 2
    g = torch.Generator().manual_seed(0)
    rope = {"type": "longrope", "short_factor": (1 + torch.rand(rotated, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rotated, generator=g)).tolist()}
    config = transformers.Phi3Config(**{
        **SHAPE, "vocab_size": 512, "rope_scaling": rope, "rope_theta": 10000.0,
        "original_max_position_embeddings": original, "max_position_embeddings": 4 * original,
        "partial_rotary_factor": partial, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2})
    torch.manual_seed(0)
    hf = sharpened(transformers.Phi3ForCausalLM(config).float().eval())
    # named phi3: llama.cpp looks Phi-3's special tokens up by the name
    assert llama_cpp_error(hf, tmp_path / "phi3-tiny", 100, 128) < 1e-5


def test_gguf_export_refuses_yarn_without_truncation(tmp_path):
    from lathe.model import CheckpointError
    from lathe.serve.gguf_export import export_gguf
    config = transformers.Qwen2Config(**{**SHAPE, "rope_scaling": ROPE["yarn-no-truncate"]})
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "hf")
    with_tokenizer(tmp_path / "hf", vocab_size=262)
    with pytest.raises(CheckpointError, match="llama.cpp's YaRN rounds its ramp's ends"):
        export_gguf(tmp_path / "hf", tmp_path / "out.gguf")


@pytest.mark.parametrize(("name", "reason"), [
    ("smollm3", "SmolLM3's NoPE layers"),
    ("mistral-window", "llama.cpp's llama attends in full, not in a window"),
    ("phi3-window", "llama.cpp's phi3 attends in full, not in a window"),
    ("gemma2", "scales queries by head_dim^-1/2, not by query_pre_attn_scalar=24"),
    ("qwen3_moe", "llama.cpp's qwen3moe has experts in every layer (no mlp_only_layers)"),
    ("olmoe", "clamps q, k and v before the q/k norms"),
    ("olmoe", "it takes no grouped KV heads"),
    ("olmo3", "rotates its sliding layers with the full ones' base"),
    ("olmo3-alternating", "llama.cpp's olmo2 slides 3 of each 4 layers"),
])
def test_gguf_export_refuses_what_llama_cpp_would_compute_otherwise(tmp_path, name, reason):
    from lathe.model import CheckpointError
    from lathe.serve.gguf_export import export_gguf
    saved(name, tmp_path / "hf")
    with_tokenizer(tmp_path / "hf", vocab_size=262)
    with pytest.raises(CheckpointError, match=re.escape(reason)):
        export_gguf(tmp_path / "hf", tmp_path / "out.gguf")


ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0,
                         "original_max_position_embeddings": 64, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope", ROPE.values(), ids=ROPE.keys())
def test_rope_scalings_give_transformers_logits_and_export_back(tmp_path, rope):
    config = transformers.Qwen2Config(**{**SHAPE, "rope_scaling": rope,
                                         "rope_theta": 10000.0})
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 200))  # past the original context
    with torch.no_grad():
        expected = hf(ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours(ids).logits - expected).abs().max() <= 1e-4
        save_checkpoint(ours, tmp_path / "lathe")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                                  dtype=torch.float32).eval()
        assert (again(ids).logits - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("partial", [1.0, 0.75])  # Phi-3.5-mini, Phi-4-mini
def test_longrope_gives_transformers_logits_within_and_past_the_original_context(tmp_path,
                                                                                  partial):
    """LongRoPE as Phi-3.5 and Phi-4-mini ship it (`type: longrope` beside a top-level
    original_max_position_embeddings): short factors within the original context, long ones
    for a forward that passes it, cos/sin scaled by sqrt(1 + ln(256/64) / ln 64); exported
    back as the same config."""
    rotated = int(16 * partial) // 2
    g = torch.Generator().manual_seed(0)
    rope = {"type": "longrope", "short_factor": (1 + torch.rand(rotated, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rotated, generator=g)).tolist()}
    config = transformers.Phi3Config(**{**SHAPE, "rope_scaling": rope, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 64,
                                        "partial_rotary_factor": partial,
                                        "pad_token_id": 0})
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    assert ours.config.rope_scaling.rope_type == "longrope"
    with torch.no_grad():
        for length in (40, 200):  # within the original 64 positions, and past them
            ids = torch.randint(0, 256, (1, length), generator=g)
            assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-4, length
        save_checkpoint(ours, tmp_path / "lathe")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                                  dtype=torch.float32).eval()
        assert (again(ids).logits - hf(ids).logits).abs().max() <= 1e-4


def test_dynamic_ntk_gives_transformers_logits_within_and_past_the_original_context(tmp_path):
    """Dynamic NTK (`rope_type: dynamic`, factor 4 over 64 positions): the plain base within
    the 64, a base stretched to the forward's length past them, as a fresh transformers model
    computes it (one that ran a longer forward before keeps that forward's base; lathe's
    output does not depend on what ran before); the model serves 256 positions, and exports
    back the config it came from."""
    config = transformers.LlamaConfig(**{**SHAPE, "max_position_embeddings": 64,
                                         "rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
                                         "rope_theta": 10000.0})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # sharper attention: positions matter more
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf")
    assert ours.config.rope_scaling.rope_type == "dynamic" and ours.config.max_seq_len == 256
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for length in (40, 200, 120):
            ids = torch.randint(0, 256, (1, length), generator=g)
            fresh = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / "hf", dtype=torch.float32).eval()
            assert (ours(ids).logits - fresh(ids).logits).abs().max() <= 1e-4, length
        plain = load_checkpoint(tmp_path / "hf")
        plain.config.rope_scaling = None  # what a model without the stretch computes
        assert (plain(ids).logits - fresh(ids).logits).abs().max() > 1e-2
        save_checkpoint(ours, tmp_path / "lathe")
        written = json.loads((tmp_path / "lathe" / "config.json").read_text())
        assert written["max_position_embeddings"] == 64
        assert written["rope_scaling"] == {"rope_type": "dynamic", "factor": 4.0}
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                                  dtype=torch.float32).eval()
        assert (again(ids).logits - fresh(ids).logits).abs().max() <= 1e-4




@pytest.mark.parametrize("name", ["llama-attention-bias", "qwen3", "gemma2", "gemma3", "phi3",
                                  "qwen3_moe", "olmo3"])
def test_reward_models_load_and_export_as_their_familys_sequence_classifier(tmp_path, name):
    """A family's `…ForSequenceClassification` (one label: a reward model) loads with its
    scores at every position, and exports as the same class whose score — read at each
    row's last token that is not the pad id — is ours there."""
    config_class, extra = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**SHAPE, **extra, "num_labels": 1,
                                                    "pad_token_id": 0})
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():
        hf.score.weight.mul_(30)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(1, 256, (2, 40))
    ids[1, 25:] = 0  # the second row padded after 25 tokens
    ours = load_checkpoint(tmp_path / "hf")
    assert ours.config.num_labels == 1 and not hasattr(ours, "lm_head")
    with torch.no_grad():
        scores = ours(ids).logits[:, :, 0]
        expected = hf(ids).logits[:, 0]
        assert (scores[[0, 1], [39, 24]] - expected).abs().max() <= 1e-4
    save_checkpoint(ours, tmp_path / "lathe", tokenizer=None)
    written = json.loads((tmp_path / "lathe" / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__] and len(written["id2label"]) == 1
    again = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "lathe", dtype=torch.float32, pad_token_id=0).eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert (again(ids).logits[:, 0] - expected).abs().max() <= 1e-4


def test_a_reward_model_starts_from_a_language_models_decoder(tmp_path):
    from lathe.core.errors import ConfigError
    from lathe.model import ModelConfig
    from lathe.model.checkpoint import OpenCheckpoint
    saved("qwen3", tmp_path / "lm")
    lm = load_checkpoint(tmp_path / "lm")
    torch.manual_seed(3)
    classifier = OpenCheckpoint(tmp_path / "lm").model(num_labels=1)
    assert classifier.score.weight.shape == (1, 64) and not hasattr(classifier, "lm_head")
    assert 0.01 < classifier.score.weight.std().item() < 0.04  # N(0, initializer_range)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():  # the decoder is the language model's
        hidden = lm(ids, head=False).hidden
        torch.testing.assert_close(classifier(ids).logits, hidden @ classifier.score.weight.T)
    with pytest.raises(ConfigError, match="transformers has no sequence classifier of family "
                                          "'olmoe'"):
        ModelConfig(family="olmoe", qk_norm_projection=True, n_experts=4, num_labels=1)
