"""LoRA through peft on the shared Transformer: frozen base, merge, adapter folders."""

from __future__ import annotations

import pytest
import torch

from lathe.model.lora import (
    LoraSection,
    adapters_disabled,
    apply_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)
from lathe.model.recipe import ConfigError
from tests.builders import tiny_model


def trained_adapter() -> torch.nn.Module:
    model = apply_lora(tiny_model(n_layers=2), LoraSection(enabled=True, r=4, alpha=8))
    with torch.no_grad():  # B starts at zero: give the adapter something to say
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def test_only_adapters_train_and_disabling_them_gives_the_base():
    base = tiny_model(n_layers=2)
    model = trained_adapter()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, base(ids).logits, atol=1e-4)
        with adapters_disabled(model):
            torch.testing.assert_close(model(ids).logits, base(ids).logits)


def test_merged_model_gives_the_adapter_models_logits(tmp_path):
    model = trained_adapter()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    save_adapter(model, LoraSection(enabled=True, r=4, alpha=8), tmp_path / "adapter")
    reloaded = load_adapter(tiny_model(n_layers=2), tmp_path / "adapter")
    merged = merge_lora(model)
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_adapter_folder_loads_in_peft_on_transformers(tmp_path):
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from lathe.model import save_checkpoint
    model = trained_adapter()
    save_adapter(model, LoraSection(enabled=True, r=4, alpha=8), tmp_path / "adapter")
    base = tiny_model(n_layers=2)
    save_checkpoint(base, tmp_path / "base")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "base", config=LlamaConfig.from_pretrained(
        tmp_path / "base"))
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, model(ids).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_qlora_without_cuda_says_so():
    with pytest.raises(ConfigError, match="lora.qlora=true needs a CUDA GPU"):
        apply_lora(tiny_model(n_layers=1), LoraSection(enabled=True, qlora=True))
