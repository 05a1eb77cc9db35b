"""Post-training a Qwen2 checkpoint that transformers wrote (with lathe's tokenizer, whose
chat template the stages render): SFT and DPO steps with LoRA run, and the merged export
loads in transformers as Qwen2ForCausalLM with lathe's logits; the adapter folder loads in
peft on the original class."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.data.tokenizer import load_tokenizer
from lathe.model import load_checkpoint
from lathe.model.checkpoint import TOKENIZER_FILES
from tests.posttrain.conftest import quick
from tests.posttrain.test_stages import preference_files

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_base(base, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen") / "base"
    tokenizer = load_tokenizer(base)
    eos = tokenizer.token_to_id("<|end_of_turn|>")
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=eos, bos_token_id=tokenizer.token_to_id("<|begin_of_text|>"))
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)
    return folder


def logits_agree(folder: Path, ids: torch.Tensor) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(folder)(ids).logits,
                                   theirs.eval()(ids).logits, atol=1e-4, rtol=1e-4)


def test_sft_and_dpo_with_lora_on_a_qwen2_checkpoint(qwen_base, tmp_path):
    from peft import PeftModel
    ids = torch.randint(0, 300, (1, 24))
    sft = tmp_path / "sft"
    assert main(["sft", *quick(sft, qwen_base, max_steps=2, **{"lora.enabled": "true",
                                                               "optim.lr": 3e-3})]) == 0
    logits_agree(sft / "final", ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen_base, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, sft / "final-adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, load_checkpoint(sft / "final")(ids).logits,
                                   atol=1e-4, rtol=1e-4)

    files = preference_files(tmp_path)
    dpo = tmp_path / "dpo"
    assert main(["dpo", *quick(dpo, sft / "final", max_steps=2, **{
        "lora.enabled": "true", "data.train": files["train"], "data.eval": files["test"]})]) == 0
    logits_agree(dpo / "final", ids)
