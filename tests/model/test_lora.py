"""LoRA through peft on the shared Transformer: frozen base, merge, adapter folders."""

from __future__ import annotations

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.model.lora import (
    AdapterMerger,
    LoraSection,
    adapter_weights,
    adapters_disabled,
    apply_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)
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
    save_adapter(model, LoraSection(enabled=True, r=4, alpha=8), tmp_path / "adapter",
                 tmp_path / "base")
    reloaded = load_adapter(tiny_model(n_layers=2), tmp_path / "adapter")
    merged = merge_lora(model)
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_adapter_folder_loads_with_auto_peft_from_its_own_config(tmp_path, monkeypatch):
    """adapter_config.json names its base (absolute) and task type, so
    `AutoPeftModelForCausalLM.from_pretrained(adapter)` needs nothing else."""
    import json

    from peft import AutoPeftModelForCausalLM

    from lathe.model import save_checkpoint
    model = trained_adapter()
    save_checkpoint(tiny_model(n_layers=2), tmp_path / "base")
    save_adapter(model, LoraSection(enabled=True, r=4, alpha=8), tmp_path / "adapter",
                 tmp_path / "base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    monkeypatch.chdir(tmp_path / "adapter")  # the base is found from anywhere
    peft_model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, model(ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_adapter_merger_gives_merged_weights_without_touching_its_base():
    """What GRPO's rollout engine loads under (Q)LoRA: base + adapters, merged by peft;
    merging twice gives the same weights, and a foreign adapter is refused."""
    model = trained_adapter()
    merger = AdapterMerger(tiny_model(n_layers=2), LoraSection(enabled=True, r=4, alpha=8))
    adapters = adapter_weights(model)
    first = merger(adapters)
    second = merger(adapters)
    expected = merge_lora(model).state_dict()
    assert set(first) == set(expected)
    for name in expected:
        torch.testing.assert_close(first[name], expected[name], atol=1e-6, rtol=0)
        assert torch.equal(first[name], second[name])
    with pytest.raises(ValueError, match="do not match"):
        merger({k: v for k, v in adapters.items() if "layers.0." not in k})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_qlora_without_cuda_says_so():
    with pytest.raises(ConfigError, match="lora.qlora=true needs a CUDA GPU"):
        apply_lora(tiny_model(n_layers=1), LoraSection(enabled=True, qlora=True))
