"""The transformer's behaviour: causality, attention against a hand-written reference,
KV-cache decoding, the loss, FLOP accounting and reference generation."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lathe.model import ContiguousKVCache, generate
from tests.builders import GEMMA4, GEMMA4_E2B, tiny_model


def reference_logits(model, ids):
    """An independent forward: explicit softmax attention with KV heads repeated per group."""
    cfg = model.config
    batch, seq = ids.shape
    x = model.model.embed_tokens.weight[ids]
    pos = torch.arange(seq, dtype=torch.float32)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    angles = torch.outer(pos, inv_freq).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()

    def rope(t):
        half = cfg.head_dim // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    def norm(t, weight):
        return weight * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in model.model.layers:
        a = layer.self_attn
        h = norm(x, layer.input_layernorm.weight)
        q = (h @ a.q_proj.weight.T).view(batch, seq, cfg.n_heads, -1).transpose(1, 2)
        k = (h @ a.k_proj.weight.T).view(batch, seq, cfg.n_kv_heads, -1).transpose(1, 2)
        v = (h @ a.v_proj.weight.T).view(batch, seq, cfg.n_kv_heads, -1).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(1, 2).reshape(batch, seq, -1) @ a.o_proj.weight.T
        h = norm(x, layer.post_attention_layernorm.weight)
        m = layer.mlp
        x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return norm(x, model.model.norm.weight) @ model.lm_head.weight.T


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_attention_matches_reference_for_mha_gqa_mqa(n_kv_heads):
    model = tiny_model(n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        got = model(ids).logits
        want = reference_logits(model, ids)
    assert (got - want).abs().max() < 1e-5


def test_changing_later_tokens_never_changes_earlier_logits():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        base = model(ids).logits
        for t in (0, 13, 38):
            changed = ids.clone()
            changed[:, t + 1:] = torch.randint(0, 256, changed[:, t + 1:].shape)
            assert not torch.equal(changed, ids)
            logits = model(changed).logits
            assert torch.allclose(logits[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0)
            assert not torch.allclose(logits[:, t + 1:], base[:, t + 1:], atol=1e-3)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 9, 50])
def test_token_by_token_decoding_with_cache_matches_full_forward(batch, length):
    model = tiny_model()
    ids = torch.randint(0, 256, (batch, length))
    cache = ContiguousKVCache(model.config, batch, length)
    with torch.no_grad():
        full = model(ids).logits
        stepped = torch.cat([model(ids[:, t:t + 1], kv_cache=cache).logits
                             for t in range(length)], dim=1)
    assert (stepped - full).abs().max() <= 1e-5


def test_chunked_prefill_then_decode_matches_full_forward():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 30))
    cache = ContiguousKVCache(model.config, 2, 30)
    with torch.no_grad():
        full = model(ids).logits
        chunks = [model(ids[:, a:b], kv_cache=cache).logits
                  for a, b in ((0, 11), (11, 12), (12, 25), (25, 30))]
    assert (torch.cat(chunks, dim=1) - full).abs().max() <= 1e-5


def test_cache_refuses_to_overflow():
    model = tiny_model()
    cache = ContiguousKVCache(model.config, 1, 8)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="max_len=8"):
            model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)


def test_loss_is_shifted_cross_entropy_ignoring_minus_100():
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 16))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(ids, labels=labels)
    want = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1),
                           ignore_index=-100)
    assert torch.allclose(out.loss, want)
    assert abs(out.loss.item() - math.log(256)) < 0.1  # a fresh model is near uniform
    assert model(ids).loss is None


def test_backward_reaches_every_parameter_and_tied_head_shares_the_embedding():
    model = tiny_model().train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (2, 16))
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("overrides", [{}, GEMMA4, GEMMA4_E2B])
def test_flops_per_token_equals_counted_matmul_flops_of_a_training_step(overrides):
    model = tiny_model(**overrides).train()
    batch, seq = 2, 64
    ids = torch.randint(0, 256, (batch, seq))
    # The math backend runs attention as counted bmm ops (CPU's fused kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == model.config.flops_per_token(seq) * batch * seq


def test_num_params_matches_module_parameters():
    for overrides in ({}, {"tie_embeddings": False}, {"n_kv_heads": 1}, GEMMA4, GEMMA4_E2B):
        model = tiny_model(**overrides)
        actual = sum(p.numel() for p in model.parameters())  # a tied matrix is yielded once
        embeddings = model.model.embed_tokens.weight.numel() + (
            0 if model.config.tie_embeddings else model.lm_head.weight.numel())
        if model.config.per_layer_dim:
            embeddings += model.model.embed_tokens_per_layer.weight.numel()
        assert model.config.num_params() == actual
        assert model.config.num_params(include_embeddings=False) == actual - embeddings


def test_kv_sharing_layers_attend_over_their_sources_keys_with_a_cache_and_without():
    """Gemma 4 E2B's last layers compute no keys or values: a cache holds none for them
    (their buffers are their sources'), decoding token by token through it gives the full
    forward's logits, and activation checkpointing (each layer recomputed in the backward,
    the shared keys handed across layers) gives the same gradients."""
    from lathe.pretrain.runtime.converters import enable_activation_checkpointing
    model = tiny_model(**GEMMA4_E2B)
    shared = model.model.layers[4].self_attn
    assert (shared.kv_source, shared.k_proj, shared.v_proj) == (2, None, None)
    assert model.model.layers[5].mlp.up_proj.out_features == 2 * model.config.ffn_hidden_dim
    cache = ContiguousKVCache(model.config, 2, 40)
    assert cache.k[4] is cache.k[2] and cache.v[5] is cache.v[3]
    ids = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        stepped = [model(ids[:, :20], kv_cache=cache).logits]
        stepped += [model(ids[:, i:i + 1], kv_cache=cache).logits for i in range(20, 30)]
    assert (torch.cat(stepped, dim=1) - full).abs().max() < 1e-5
    seen = []  # the rows each KV-sharing layer runs on
    for layer in model.model.layers[4:]:
        layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    with torch.no_grad():  # a prompt's last logits alone: the sharing layers run that row
        last = model(ids[:, :20], kv_cache=ContiguousKVCache(model.config, 2, 40),
                     logits_to_keep=torch.tensor([19])).logits
        assert (last[:, 0] - full[:, 19]).abs().max() < 1e-5 and seen == [1, 1]
        model(ids[:, :20], kv_cache=ContiguousKVCache(model.config, 2, 40),
              logits_to_keep=torch.tensor([3, 19]))  # not the prompt's last rows: all rows
    assert seen == [1, 1, 20, 20]
    model.train()
    model(ids, labels=ids).loss.backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert plain["model.layers.2.self_attn.k_proj.weight"].abs().sum() > 0
    model.zero_grad()
    enable_activation_checkpointing(model)
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, plain[name], atol=1e-6), name


def test_init_scales_residual_projections_down_with_depth():
    model = tiny_model()
    std = model.config.init_std
    residual = std / math.sqrt(2 * model.config.n_layers)
    layer = model.model.layers[0]
    assert abs(layer.self_attn.q_proj.weight.std().item() - std) < 0.1 * std
    assert abs(layer.mlp.down_proj.weight.std().item() - residual) < 0.1 * residual
    assert torch.equal(layer.input_layernorm.weight, torch.ones(model.config.dim))


def test_greedy_generate_equals_full_recompute_argmax():
    model = tiny_model()
    prompt = torch.randint(0, 256, (3, 7))
    new = generate(model, prompt, 12)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 7:])


def test_generate_stops_at_eos_and_pads_finished_rows():
    model = tiny_model()
    prompt = torch.randint(0, 256, (2, 5))
    first = generate(model, prompt, 1)
    eos = first[0, 0].item()  # row 0 emits eos immediately
    new = generate(model, prompt, 10, eos_token_id=eos)
    assert (new[0] == eos).all()
    if (new[1] != eos).all():
        assert new.shape[1] == 10
    else:
        assert new.shape[1] <= 10 and new[1, -1] == eos


def test_sampling_is_reproducible_with_a_seed_and_respects_top_k():
    model = tiny_model()
    prompt = torch.randint(0, 256, (2, 5))

    def run(seed, **kw):
        return generate(model, prompt, 8, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    assert torch.equal(run(3, top_k=1), generate(model, prompt, 8))


@pytest.mark.parametrize("kernels", ["0", "force"])
def test_an_fp32_cache_serves_bf16_activations(kernels, monkeypatch):
    """Under bf16 autocast, K/V arrive in bf16 while the cache is fp32: the cache stores and
    attends in its own dtype and hands back q's, so generation runs either way."""
    monkeypatch.setenv("LATHE_KERNELS", kernels)
    model = tiny_model(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_hidden_dim=64)
    prompt = torch.randint(0, 256, (2, 5))
    with torch.autocast("cpu", torch.bfloat16):
        fp32_cache = generate(model, prompt, 4, kv_dtype=torch.float32)
        bf16_cache = generate(model, prompt, 4, kv_dtype=torch.bfloat16)
    assert fp32_cache.shape == bf16_cache.shape == (2, 4)


def test_head_false_gives_the_hidden_states_compute_logits_maps_to_the_logits():
    """A compiled serving step stops at the final norm and applies the head to the rows it
    keeps: `compute_logits` of those states is the full forward's logits; labels without
    the head (no loss to compute) are refused by name."""
    model = tiny_model().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        out = model(ids, head=False)
        assert out.logits is None and out.hidden.shape == (2, 9, model.config.dim)
        torch.testing.assert_close(model.compute_logits(out.hidden[:, 3:5]),
                                   model(ids).logits[:, 3:5])
    with pytest.raises(ValueError, match="head=False"):
        model(ids, labels=ids, head=False)
