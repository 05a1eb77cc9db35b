"""Interoperability with transformers, both ways: same logits from the same folder.

Random weights give near-uniform attention, which hides RoPE mistakes; the q/k
projections are scaled up so attention is sharp, and a sensitivity check shows that
a RoPE layout error would fail the tolerance by orders of magnitude.
"""

import pytest
import torch

from lathe.model import load_checkpoint, save_checkpoint
from tests.builders import tiny_model

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
SEQ = 96


def sharpen_attention(model, scale=8.0):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)


def hf_logits(folder, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits, model


def interleave_rope_rows(weight, n_heads):
    """Reorder each head's rows from rotate-half pairs (i, i + D/2) to adjacent pairs."""
    out, dim = weight.shape
    head_dim = out // n_heads
    w = weight.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2)
    return w.reshape(out, dim)


CASES = {
    "tied-GQA": {},
    "untied-GQA": {"tie_embeddings": False},
    "tied-MHA": {"n_kv_heads": 4},
    "untied-MHA-llama3-rope": {"n_kv_heads": 4, "tie_embeddings": False,
                               "rope_scaling": {"factor": 8.0, "original_max_seq_len": 32}},
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_transformers_loads_a_lathe_checkpoint_with_the_same_logits(tmp_path, overrides):
    model = tiny_model(**overrides)
    sharpen_attention(model)
    save_checkpoint(model, tmp_path / "ck")
    ids = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        ours = model(ids).logits
    theirs, hf = hf_logits(tmp_path / "ck", ids)
    assert (ours - theirs).abs().max() <= TOLERANCE

    # Sensitivity: the same weights in the interleaved RoPE layout must fail badly.
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(interleave_rope_rows(attn.q_proj.weight, 4))
            attn.k_proj.weight.copy_(interleave_rope_rows(attn.k_proj.weight,
                                                          model.config.n_kv_heads))
        wrong = hf(ids).logits
    assert (ours[:, 0] - wrong[:, 0]).abs().max() <= TOLERANCE  # invisible at position 0
    assert (ours - wrong).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_lathe_loads_a_transformers_save_pretrained_folder_with_the_same_logits(tmp_path, tie):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
        max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    sharpen_attention(hf)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        theirs = hf(ids).logits
        model = load_checkpoint(tmp_path / "hf")
        ours = model(ids).logits
    assert model.config.rope_scaling.original_max_seq_len == 32
    assert model.config.tie_embeddings == tie
    assert (ours - theirs).abs().max() <= TOLERANCE
