"""Qwen3.5: Gated DeltaNet layers among gated full-attention layers, checked against
transformers' own classes on tiny random models they build and `save_pretrained` writes —
the text model and the multimodal checkpoint the hub ships (a vision tower and
multi-token-prediction weights beside the language model) load with transformers' logits
and export back as `Qwen3_5ForCausalLM`; generation through the recurrent state (lathe's
`generate` and the serving engine's, whatever the batching), packed training rows and
gradients are transformers'; what lathe does not do yet is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lathe.core.errors import ConfigError
from lathe.model import ModelConfig, Transformer, generate, load_checkpoint, save_checkpoint

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8)


def sharpen(language) -> None:
    """Random weights give near-uniform attention and near-equal logits, and start every
    (1 + w) norm at 1: move them all away, so a wrong layer cannot pass."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in language.layers:
            mixer = getattr(layer, "linear_attn", None)
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if mixer is not None:
                mixer.in_proj_qkv.weight.mul_(4)
                mixer.conv1d.weight.mul_(3)
                mixer.norm.weight.copy_(1 + 0.3 * torch.randn(mixer.norm.weight.shape,
                                                              generator=generator))
                mixer.dt_bias.copy_(torch.randn(mixer.dt_bias.shape, generator=generator))
            else:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
            for norm in norms:
                norm.weight.copy_(0.3 * torch.randn(norm.weight.shape, generator=generator))


def hf_text_model(folder=None, **extra):
    config = transformers.Qwen3_5TextConfig(**{**TEXT, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    sharpen(model.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    if folder is not None:
        model.save_pretrained(folder)
    return model


def test_the_text_model_loads_and_exports_with_transformers_logits(tmp_path):
    hf = hf_text_model(tmp_path / "hf")
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert ours.config.num_params() == sum(p.numel() for p in hf.parameters())
    save_checkpoint(ours, tmp_path / "lathe")
    written = json.loads((tmp_path / "lathe" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (
        "qwen3_5_text", ["Qwen3_5ForCausalLM"])
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again) is type(hf)
    assert again.config.layer_types == hf.config.layer_types
    assert again.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert set(again.state_dict()) == set(hf.state_dict())
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_the_hubs_multimodal_checkpoint_loads_as_its_language_model(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: the language model under
    model.language_model., a vision tower under model.visual., and multi-token-prediction
    weights (mtp.) that its class ignores; the text config sparse, as the hub's."""
    vision = transformers.models.qwen3_5.Qwen3_5VisionConfig(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    config = transformers.Qwen3_5Config(
        text_config={**TEXT, "model_type": "qwen3_5_text"}, vision_config=vision.to_dict())
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    sharpen(model.model.language_model)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(tmp_path / "hf")
    weights = next((tmp_path / "hf").glob("*.safetensors"))
    state = load_file(weights)
    assert any(name.startswith("model.visual.") for name in state)
    state["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(128, 64)  # what the hub's hold
    save_file(state, weights, metadata={"format": "pt"})
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    sparse = {key: value for key, value in written["text_config"].items()
              if key in TEXT or key == "model_type"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**written, "text_config": sparse}))
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert ours.config.family == "qwen3_5_text"
        assert ours.config.partial_rotary_factor == 0.25  # the wrapper's default text config
        assert (ours(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    save_checkpoint(ours, tmp_path / "lathe")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()


def generates_as_transformers(hf, ours, steps: int) -> None:
    """`generate`'s prefill (the chunked rule over 70 tokens) and decode steps (the
    recurrence from the cached states) give transformers' greedy tokens for two rows."""
    prompts = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                             max_new_tokens=steps, do_sample=False)[:, 70:]
    assert torch.equal(generate(ours, prompts, steps), theirs)
    assert len(set(theirs[0].tolist())) > 4  # not one token repeated


def test_generation_carries_the_recurrent_state_as_transformers_does(tmp_path):
    generates_as_transformers(hf_text_model(tmp_path / "hf"), load_checkpoint(tmp_path / "hf"),
                              24)


def test_packed_documents_are_computed_as_each_alone():
    config = ModelConfig.from_preset("tiny", family="qwen3_5_text", vocab_size=256)
    torch.manual_seed(0)
    model = Transformer(config).eval()
    documents = torch.tensor([[0] * 30 + [1] * 70 + [2] * 28])
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(ids, documents=documents).logits
        for doc in range(3):
            at = (documents[0] == doc).nonzero().squeeze(1)
            assert (model(ids[:, at]).logits - packed[:, at]).abs().max() < 1e-4
        assert (model(ids).logits - packed).abs().max() > 1e-2


def test_gradients_are_transformers(tmp_path):
    hf = hf_text_model(tmp_path / "hf")
    ours = load_checkpoint(tmp_path / "hf").train()
    hf.train()
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(4))
    hf(ids, labels=ids).loss.backward()
    ours(ids, labels=ids, return_logits=False).loss.backward()
    theirs = dict(hf.named_parameters())
    for name, parameter in ours.named_parameters():
        reference = theirs[name].grad
        assert (parameter.grad - reference).abs().max() <= 1e-4 * reference.abs().max() + 1e-8, \
            name


def test_bf16_autocast_stays_close():
    config = ModelConfig.from_preset("tiny", family="qwen3_5_text", vocab_size=256)
    torch.manual_seed(0)
    model = Transformer(config)
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(5))
    exact = model(ids, labels=ids, return_logits=False).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
    assert abs(loss.item() - exact.item()) < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def full_forward_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("engine", [
    {"num_blocks": 64},  # whole prompts, their first tokens decoded together
    {"num_blocks": 64, "max_num_batched_tokens": 48},  # prompts in chunks beside decodes
    {"num_blocks": 64, "decode_steps": 4},  # several decode passes a step
    {"num_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64},  # preempted, redone
    # no snapshots to cut them: the prompts whole, or in chunks that continue their states
    {"num_blocks": 64, "prefix_caching": False},
    {"num_blocks": 64, "prefix_caching": False, "max_num_batched_tokens": 100},
    # decodes through the compiled steps, which read and write the states of their rows
    {"num_blocks": 64, "max_num_seqs": 4, "compile_decode": True},
    {"num_blocks": 64, "max_num_seqs": 4, "compile_decode": True, "decode_steps": 4},
    {"num_blocks": 40, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4,
     "compile_decode": True},
], ids=["whole", "chunked", "multi-step", "preempted", "uncached", "uncached-chunks",
        "compiled", "compiled-multi-step", "compiled-preempted"])
def test_the_engine_serves_each_sequence_from_its_own_state(tmp_path, engine):
    """The paged engine keeps each sequence's linear-attention states by its row: however
    a step mixes prefill chunks and decodes of other sequences, and after a preemption
    recomputes a sequence from its first token, the greedy tokens are transformers'. Its
    compiled decode steps carry the states too, and a preempted sequence's row goes back,
    so the states never outgrow the tensors the steps were built over."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    generator = torch.Generator().manual_seed(0)
    # three of one length: run as one batch of rows wherever they step alike
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist()
               for n in (5, 40, 130, 1, 77, 40, 33, 40)]
    served = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(**engine))
    outputs = served.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                      ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == full_forward_greedy(hf, prompt, 16)
    if "block_size" in engine:
        assert served.scheduler.num_preemptions > 0
    if engine.get("compile_decode"):
        assert served.runner.graphs.steps > 0 and served.runner.graphs.states_current


def test_the_engine_samples_n_and_scores_prompts_as_transformers(tmp_path):
    """n > 1 siblings resume from the states the first kept at its prompt's last block
    boundary (32 of its 40 tokens cached each), and a prompt's log-probabilities are
    transformers'."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    served = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(num_blocks=64))
    (output,) = served.generate([prompt], SamplingParams(max_tokens=12, temperature=0, n=3,
                                                         ignore_eos=True, prompt_logprobs=0))
    expected = full_forward_greedy(hf, prompt, 12)
    assert [sample.token_ids for sample in output.outputs] == [expected] * 3
    assert served.stats()["prefix_cache_hits"] == 2 * 32
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    theirs = [scores[i, token].item() for i, token in enumerate(prompt[1:])]
    ours = [entry.logprob for entry in output.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_states_after_the_accepted_drafts(tmp_path, method):
    """Prompt lookup, or an attention-only draft model: the target verifies each step's
    drafts in one pass, its linear-attention states are those after the last token it
    accepts (not after the rejected ones), and its greedy tokens are transformers'. Prompt
    lookup's drafts are both accepted and rejected here; all the random draft model's are
    rejected; several sequences draft at once, a chunked prompt beside them."""
    from lathe.serve.config import EngineConfig, SpeculativeConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    torch.manual_seed(3)
    draft = Transformer(ModelConfig.from_preset("tiny", vocab_size=256)) \
        if method == "draft" else None
    served = LLMEngine(load_checkpoint(tmp_path / "hf"), draft_model=draft, config=EngineConfig(
        num_blocks=64, max_num_batched_tokens=48,
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=3)))
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 256, (6,), generator=generator).tolist() * 5 for _ in range(2)]
    prompts.append(torch.randint(0, 256, (70,), generator=generator).tolist())
    outputs = served.generate(prompts, SamplingParams(max_tokens=64, temperature=0,
                                                      ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == full_forward_greedy(hf, prompt, 64)
    stats = served.stats()
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if method == "ngram":  # the random draft model's guesses are all rejected
        assert stats["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_model_with_linear_attention_is_refused():
    from lathe.serve.config import EngineConfig, SpeculativeConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.request_checks import RequestError

    model = Transformer(ModelConfig.from_preset("tiny", family="qwen3_5_text"))
    with pytest.raises(RequestError, match="draft model has linear-attention layers"):
        LLMEngine(model, draft_model=model, config=EngineConfig(
            speculative=SpeculativeConfig(method="draft")))


@pytest.mark.parametrize(("changes", "message"), [
    ({"family": "qwen3", "layer_types": ["linear_attention"] * 4},
     "family='qwen3' has no 'linear_attention' layers"),
    ({"linear_value_heads": 6}, "linear_value_heads=6 is not a multiple of linear_key_heads=4"),
    ({"linear_key_head_dim": 0}, "linear_key_head_dim=0 must be a positive integer"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
     "needs sliding_window"),
])
def test_a_linear_attention_config_is_checked_field_by_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_preset("tiny", **{"family": "qwen3_5_text", **changes})


def test_a_config_json_without_its_output_gate_is_refused(tmp_path):
    hf = transformers.Qwen3_5TextConfig(**TEXT).to_dict()
    with pytest.raises(ConfigError, match="attn_output_gate=false"):
        ModelConfig.from_hf_config({**hf, "attn_output_gate": False})
    assert ModelConfig.from_hf_config(hf).linear_value_heads == 4


def llama_cpp_error(hf, folder, length: int) -> tuple[float, object]:
    """`hf` saved to `folder` with a Qwen3.5-shaped tokenizer and exported to an f32 GGUF: the
    largest difference between llama.cpp's logits and lathe's over `length` tokens, relative
    to lathe's largest, and the file."""
    from lathe.serve.gguf_export import export_gguf
    from tests import llama_cpp_runtime
    from tests.builders import build_qwen3_5_tokenizer

    hf.save_pretrained(folder)
    build_qwen3_5_tokenizer(folder, vocab_size=400)
    out = export_gguf(folder, folder.with_suffix(".gguf"), dtype="f32")
    ids = torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        ours = load_checkpoint(folder)(torch.tensor([ids])).logits[0]
    theirs = llama_cpp_runtime.LlamaCpp(out, 256).logits(ids)
    return float((theirs - ours).abs().max() / ours.abs().max()), out


TEXTS = ["Hello world, this is a test.\nÉtudiant naïve café — 東京タワー",
         "def add(a, b):\n    return a + b  # 12345",
         "the quick brown fox\n\n\tjumps   over",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("key_heads", [2, 4], ids=["grouped-values", "one-value-a-key"])
def test_its_gguf_gives_llama_cpps_logits_and_tokens(tmp_path, key_heads):
    """Exported as llama.cpp's qwen35 (its converter's tensors: A = −exp(A_log), the
    convolution 2-D, the value heads tiled where key heads serve several; (1 + w) norms but
    the DeltaNet's own), llama.cpp computes lathe's logits over 150 tokens, through the
    linear layers' recurrence and the gated full layer; its vocabulary (Qwen3.5's regex,
    `qwen35`) tokenizes and detokenizes text as transformers does."""
    from transformers import PreTrainedTokenizerFast

    from tests import llama_cpp_runtime

    llama_cpp_runtime.library()
    hf = hf_text_model(linear_num_key_heads=key_heads, vocab_size=403)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.normal_(0, 1)
    error, out = llama_cpp_error(hf, tmp_path / "hf", 150)
    assert error < 1e-4
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    vocabulary = llama_cpp_runtime.LlamaCpp(out)
    for text in TEXTS:
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert vocabulary.tokenize(text, special=True) == expected
        assert vocabulary.detokenize(expected, special=True) == text


def test_a_layer_pattern_llama_cpp_cannot_hold_is_refused():
    from lathe.serve.gguf_export import unwritable

    config = ModelConfig.from_preset("tiny", family="qwen3_5_text", layer_types=[
        "linear_attention", "full_attention", "full_attention", "linear_attention"])
    assert "attends in every N-th layer alone" in unwritable(config)
    assert unwritable(ModelConfig.from_preset("tiny", family="qwen3_5_text")) is None
    # llama.cpp fails to load such a file (tried)
    wide = ModelConfig.from_preset("tiny", family="qwen3_5_text", linear_value_head_dim=32)
    assert "value heads as wide as its key heads" in unwritable(wide)


def test_int8_serving_keeps_the_decay_projections_full(tmp_path):
    """Quantized serving rounds the Gated DeltaNet's big projections but not its per-head
    decay and learning-rate rows (`in_proj_a`, `in_proj_b`), as the router and LM head; the
    quantized engine's greedy tokens are the full one's on this model, its decode steps eager
    or compiled."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.quant import Int8Linear
    from lathe.serve.sampling_params import SamplingParams

    hf_text_model(tmp_path / "hf")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(7)).tolist()
    full = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=64))
    rounded = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(num_blocks=64),
                                        quantize="int8")
    mixer = rounded.model.model.layers[0].linear_attn
    assert isinstance(mixer.in_proj_qkv, Int8Linear) and isinstance(mixer.out_proj, Int8Linear)
    for kept in (mixer.in_proj_a, mixer.in_proj_b):  # on CPU, lathe's few-row DecodeLinear
        assert not isinstance(kept, Int8Linear) and kept.weight.is_floating_point()
    expected = full.generate([prompt], params)[0].outputs[0].token_ids
    assert rounded.generate([prompt], params)[0].outputs[0].token_ids == expected
    compiled = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_num_seqs=2, compile_decode=True), quantize="int8")
    assert compiled.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert compiled.runner.graphs.steps > 0


def test_a_reward_model_loads_and_exports_as_its_sequence_classifier(tmp_path):
    """Qwen3_5TextForSequenceClassification (a reward model) loads with its scores at each
    row's last token and exports as that class."""
    config = transformers.Qwen3_5TextConfig(**TEXT, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_config(config).float().eval()
    sharpen(hf.model)
    with torch.no_grad():
        hf.score.weight.mul_(30)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(1, 256, (2, 90), generator=torch.Generator().manual_seed(8))
    ids[1, 70:] = 0  # the second row padded after 70 tokens
    ours = load_checkpoint(tmp_path / "hf")
    with torch.no_grad():
        expected = hf(ids).logits[:, 0]
        scores = ours(ids).logits[:, :, 0][[0, 1], [89, 69]]
        assert (scores - expected).abs().max() <= 1e-4 * expected.abs().max()
    save_checkpoint(ours, tmp_path / "lathe", tokenizer=None)
    again = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "lathe", dtype=torch.float32, pad_token_id=0).eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert (again(ids).logits[:, 0] - expected).abs().max() <= 1e-4 * expected.abs().max()


MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
del MOE["intermediate_size"]


def hf_moe_model(folder=None):
    """Qwen3.5-MoE's text model: Qwen3.5's layers, each MLP four experts (two a token) and
    a sigmoid-gated shared expert; its routers decisive, so no near-tie flips a choice."""
    config = transformers.Qwen3_5MoeTextConfig(**MOE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    sharpen(model.model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape,
                                                    generator=generator))
    if folder is not None:
        model.save_pretrained(folder)
    return model


def test_the_moe_loads_exports_serves_and_runs_in_llama_cpp(tmp_path):
    """Qwen3.5-MoE (35B-A3B's shape, tiny): transformers' logits, an export that loads back
    as Qwen3_5MoeForCausalLM (its experts one by one, as transformers reads them), the
    engine's greedy tokens, and its GGUF as llama.cpp's qwen35moe with lathe's logits."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams
    from tests import llama_cpp_runtime

    hf = hf_moe_model(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        ours = load_checkpoint(tmp_path / "hf")
        assert (ours.config.n_experts, ours.config.shared_expert_dim) == (4, 48)
        assert (ours(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert ours.config.num_params() == sum(p.numel() for p in hf.parameters())
    save_checkpoint(ours, tmp_path / "lathe")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lathe",
                                                              dtype=torch.float32).eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
    prompt = ids[0, :30].tolist()
    served = LLMEngine(ours, config=EngineConfig(num_blocks=64))
    (output,) = served.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True))
    assert output.outputs[0].token_ids == full_forward_greedy(hf, prompt, 12)

    llama_cpp_runtime.library()
    torch.manual_seed(0)
    big = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3_5MoeTextConfig(**dict(MOE, vocab_size=403))).float().eval()
    sharpen(big.model)
    assert llama_cpp_error(big, tmp_path / "gguf", 120)[0] < 1e-4


@pytest.mark.parametrize("wrapper", ["Qwen3_5Config", "Qwen3_5MoeConfig"])
def test_a_wrappers_sparse_text_config_reads_as_its_full_default(wrapper):
    """The hub writes a multimodal checkpoint's text_config as its difference from the
    wrapper's default: an empty one must read as that default (27B's and 35B-A3B's shapes)."""
    full = getattr(transformers, wrapper)().to_dict()
    sparse = {**full, "text_config": {"model_type": full["text_config"]["model_type"]}}
    assert ModelConfig.from_hf_config(sparse) == ModelConfig.from_hf_config(full)


@pytest.mark.parametrize(("changes", "message"), [
    ({"full_attention_interval": 0, "layer_types": None},
     "full_attention_interval=0 must be a positive integer"),
    ({"linear_num_key_heads": 0}, "linear_key_heads=0 must be a positive integer"),
    ({"intermediate_size": None}, "intermediate_size is missing"),
])
def test_a_hostile_config_json_is_refused_by_field(changes, message):
    hf = {**transformers.Qwen3_5TextConfig(**TEXT).to_dict(), **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(hf)


def adapted(folder, section, seed: int = 9):
    """The checkpoint at `folder` with `section`'s adapters, their B's random (not zero)."""
    from lathe.model.lora import apply_lora

    model = apply_lora(load_checkpoint(folder), section)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_policys_adapters_on_the_delta_net_go_into_an_engine_slot(tmp_path, compiled):
    """GRPO's rollout engine takes a LoRA policy's adapters each step into a slot: on the
    Gated DeltaNet's projections too (every one of them), serving the merged policy's
    greedy tokens — in compiled decode steps as well."""
    from lathe.model.lora import (
        DELTA_NET_LINEARS,
        LoraSection,
        adapter_pairs,
        adapter_weights,
        merge_lora,
    )
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf_text_model(tmp_path / "hf")
    section = LoraSection(enabled=True, r=4, alpha=8, target_modules=DELTA_NET_LINEARS)
    policy = adapted(tmp_path / "hf", section)
    weights = {name.removeprefix("base_model.model."): tensor
               for name, tensor in adapter_weights(policy).items()}
    engine = LLMEngine.from_checkpoint(tmp_path / "hf", EngineConfig(
        num_blocks=64, max_loras=1, max_lora_rank=4, max_num_seqs=2, compile_decode=compiled))
    engine.put_adapter("policy", adapter_pairs(weights), section.scale)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(10)).tolist()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    served = engine.generate([prompt], params, adapter="policy")[0].outputs[0].token_ids
    merged = LLMEngine(merge_lora(policy).eval(), config=EngineConfig(num_blocks=64))
    assert served == merged.generate([prompt], params)[0].outputs[0].token_ids
    assert served != engine.generate([prompt], params)[0].outputs[0].token_ids
    assert (engine.runner.graphs is not None and engine.runner.graphs.steps > 0) == compiled


def test_states_that_outgrow_the_compiled_steps_rows_decode_eagerly(tmp_path):
    """A runner of fewer rows than running sequences grows its states into new tensors, which
    the graphs were not built over: from then on its decodes run eagerly, and the greedy
    tokens stay transformers'."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.model_runner import ModelRunner
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    engine = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(
        num_blocks=64, max_num_seqs=4, prefix_caching=False))
    engine.runner = engine.executor.runner = ModelRunner(
        engine.model, engine.slabs, engine.device, engine.max_model_len, rows=2,
        compile_decode=True)
    engine.warm_up()
    warmed = engine.runner.graphs.steps  # the warm-up's runs on padding rows
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (9, 30, 17)]
    lengths = [2, 2, 10]  # the last decodes alone at the end: a batch the graphs hold
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True) for n in lengths])
    for prompt, output, n in zip(prompts, outputs, lengths, strict=True):
        assert output.outputs[0].token_ids == full_forward_greedy(hf, prompt, n)
    # the rows grew at the first step, before any decode: none ran compiled
    graphs = engine.runner.graphs
    assert not graphs.states_current and engine.runner.states.scratch >= 3
    assert graphs.steps == warmed


@pytest.mark.parametrize("engine", [
    {},  # each prompt in one chunk, snapshotted at its last block boundary
    {"max_num_batched_tokens": 24},  # in chunks, each snapshotted
    {"decode_steps": 4},  # a one-token first step in a run of decode passes
    {"max_num_seqs": 4, "compile_decode": True},  # the answer's states kept by compiled steps
    {"max_num_seqs": 4, "compile_decode": True, "decode_steps": 4},  # in runs of passes
], ids=["whole", "chunked", "multi-step", "compiled", "compiled-multi-step"])
def test_a_conversations_next_turn_resumes_from_the_kept_states(tmp_path, engine):
    """Prefix caching for linear-attention layers: a prompt that extends an earlier one and
    its answer (a chat's next turn) starts from the cached blocks up to the last block
    boundary where the states were kept — the answer's, reached while decoding — its states
    copied from there; one that shares the earlier prompt's prefix resumes where that
    prompt's prefill kept them, and one whose last token alone is new computes that token
    from them. The greedy tokens are transformers'."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    served = LLMEngine(load_checkpoint(tmp_path / "hf"),
                       config=EngineConfig(num_blocks=64, **engine))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(11)
    first = torch.randint(0, 256, (70,), generator=generator).tolist()
    answer = served.generate([first], SamplingParams(max_tokens=20, temperature=0,
                                                     ignore_eos=True))[0].outputs[0].token_ids
    turns = [(first + answer + torch.randint(0, 256, (15,), generator=generator).tolist(), 80),
             (first[:64] + torch.randint(0, 256, (30,), generator=generator).tolist(), 64),
             (first[:64] + [7], 64)]
    for prompt, cached in turns:
        hits = served.stats()["prefix_cache_hits"]
        tokens = served.generate([prompt], params)[0].outputs[0].token_ids
        assert served.stats()["prefix_cache_hits"] - hits == cached
        assert tokens == full_forward_greedy(hf, prompt, 10)


def test_the_kept_states_are_bounded_and_dropped_with_the_weights(tmp_path):
    """With room for one snapshot the second prompt's evicts the first's: the first's
    next turn computes from token 0, as with none kept or the prefix cache off; a long
    answer keeps one (/metrics counts them); new weights drop them all."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.metrics import ServerMetrics
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(12)
    a, b = (torch.randint(0, 256, (40,), generator=generator).tolist() for _ in range(2))
    for kept, config in ((1, {"recurrent_snapshots": 1}), (0, {"recurrent_snapshots": 0}),
                         (0, {"prefix_caching": False})):
        served = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(
            num_blocks=64, **config))
        served.generate([a], params)
        served.generate([b], params)
        assert served.stats().get("recurrent_snapshots", 0) == kept
        tokens = served.generate([a + [3, 4]], params)[0].outputs[0].token_ids
        assert served.stats()["prefix_cache_hits"] == 0
        assert tokens == full_forward_greedy(hf, a + [3, 4], 6)
    served = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(num_blocks=64))
    # the prompt's at 32, and of the answer's four boundaries (48 to 96) the last alone
    served.generate([a], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    assert served.stats()["recurrent_snapshots"] == 2
    metrics = ServerMetrics(served.stats, "q").render().decode()
    assert 'lathe:recurrent_snapshots{model_name="q"} 2.0' in metrics
    served.load_weights(served.model.state_dict())
    assert served.stats()["recurrent_snapshots"] == 0


def test_a_memory_plan_counts_the_engines_states_and_snapshots():
    """What a plan reserves for an engine (a rollout engine, an evaluator's) is what the
    engine holds: its slabs, a state for each row, and the snapshots at their most."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.paged_cache import engine_cache_bytes
    from lathe.serve.recurrent_states import RecurrentStates

    model = Transformer(ModelConfig.from_preset("tiny", family="qwen3_5_text"))
    config = EngineConfig(num_blocks=32, max_num_seqs=8, recurrent_snapshots=4)
    engine = LLMEngine(model, config=config)
    per_sequence = RecurrentStates.bytes_per_sequence(model.config, torch.float32)
    assert per_sequence > 0
    assert engine_cache_bytes(config, model.config, torch.float32) == \
        engine.memory["kv_cache_bytes"] + 4 * per_sequence


def test_the_serve_benchs_agent_loop_reports_each_engine(tmp_path, capsys):
    """`python -m lathe.serve.bench --sections i` on a Qwen3.5 checkpoint: the cached engine
    (eager and compiled), the whole one and transformers give the same answers turn after
    turn; a loop longer than the model's positions is skipped, not failed."""
    from lathe.serve.bench import main

    hf_text_model(tmp_path / "hf")
    flags = ["--checkpoint", str(tmp_path / "hf"), "--sections", "i", "--turn-answer", "4",
             "--turn-tokens", "8", "--no-write"]
    assert main([*flags, "--turns", "3", "--turn-context", "40"]) == 0
    table = capsys.readouterr().out.split("### (i) An agent's loop: a 40-token prompt")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| lathe, prefix cache", "| lathe, prefix cache, decode steps compiled",
        "| lathe, every prompt whole", "| transformers `generate()` on each whole prompt"]
    assert all(row.endswith("| 3/3 |") for row in rows[1:])
    assert main([*flags, "--turns", "50"]) == 0
    assert "(i) skipped" in capsys.readouterr().out


@pytest.mark.parametrize(("stride", "cached"), [(0, 0), (40, 64)])  # 40: 32, in blocks
def test_a_shared_system_prompt_resumes_from_its_stride_snapshots(tmp_path, stride, cached):
    """Two prompts that share their first 70 tokens (a system prompt) and then differ: with
    a snapshot every `stride` tokens the second resumes at the last one inside the shared
    part; with the chunk's last boundary alone (past where they differ) it cannot resume."""
    from lathe.core.errors import ConfigError
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf = hf_text_model(tmp_path / "hf")
    served = LLMEngine(load_checkpoint(tmp_path / "hf"), config=EngineConfig(
        num_blocks=64, recurrent_snapshot_stride=stride))
    generator = torch.Generator().manual_seed(14)
    system = torch.randint(0, 256, (70,), generator=generator).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    served.generate([system + torch.randint(0, 256, (10,), generator=generator).tolist()],
                    params)
    second = system + torch.randint(0, 256, (12,), generator=generator).tolist()
    tokens = served.generate([second], params)[0].outputs[0].token_ids
    assert served.stats()["prefix_cache_hits"] == cached
    assert tokens == full_forward_greedy(hf, second, 8)
    with pytest.raises(ConfigError, match="recurrent_snapshot_stride=-1 must be >= 0"):
        EngineConfig(recurrent_snapshot_stride=-1)


def test_compiled_decode_steps_under_bf16_autocast_stay_close(tmp_path):
    """Under a training stage's bf16 autocast with a bf16 cache (the conv states in bf16),
    the compiled decode steps score each decoded token within bf16's error of the eager
    steps."""
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf_text_model(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf")
    engines = [LLMEngine(model, kv_dtype=torch.bfloat16, config=EngineConfig(
        num_blocks=64, max_num_seqs=2, compile_decode=compiled)) for compiled in (False, True)]
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(16)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, compiled = (engine.generate([prompt], params)[0].outputs[0] for engine in engines)
    assert engines[1].runner.graphs.steps > 0
    assert compiled.token_ids[:2] == eager.token_ids[:2]
    assert compiled.logprobs[1].logprob == pytest.approx(eager.logprobs[1].logprob, abs=0.1)


def test_kept_states_and_drafts_under_bf16_autocast_stay_close(tmp_path):
    """A training stage's rollout engine runs under bf16 autocast with a bf16 cache: a next
    turn resumed from the kept states (in bf16), with prompt-lookup drafts, scores its first
    answer token within bf16's error of an engine that computes the prompt whole."""
    from lathe.serve.config import EngineConfig, SpeculativeConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    hf_text_model(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf")
    resumed = LLMEngine(model, kv_dtype=torch.bfloat16, config=EngineConfig(
        num_blocks=64, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)))
    whole = LLMEngine(model, kv_dtype=torch.bfloat16, config=EngineConfig(
        num_blocks=64, prefix_caching=False))
    generator = torch.Generator().manual_seed(15)
    first = torch.randint(0, 256, (6,), generator=generator).tolist() * 8
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        answer = resumed.generate([first], params)[0].outputs[0].token_ids
        turn = first + answer + [5, 6, 7]
        got = resumed.generate([turn], params)[0].outputs[0]
        want = whole.generate([turn], params)[0].outputs[0]
    assert resumed.stats()["prefix_cache_hits"] == 48
    assert resumed.runner.states.conv[0].dtype == torch.bfloat16
    assert got.token_ids[0] == want.token_ids[0]
    assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0].logprob, abs=0.1)
