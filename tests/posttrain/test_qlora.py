"""QLoRA (a 4-bit NF4 base through bitsandbytes, LoRA adapters in full precision) for SFT,
DPO and GRPO: each trains, exports the adapters merged into the full-precision base, and
writes an adapter folder that matches that export. Needs CUDA and bitsandbytes: skipped
cleanly elsewhere (CI has neither)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lathe.core.cli import main
from lathe.model import load_checkpoint
from lathe.model.lora import load_adapter, merge_lora
from tests.posttrain.conftest import quick

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs a CUDA GPU and bitsandbytes")


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_qlora_trains_and_exports_merged(stage, base, tmp_path):
    out = tmp_path / stage
    settings = {"max_steps": 2, "lora.enabled": "true", "lora.qlora": "true", "lora.r": 4}
    if stage == "grpo":
        # digit_share, not the exact answer a random model never gives: with every reward 0
        # the advantages are 0, the zero-initialized B never moves and nothing is learned
        settings.update(prompts_per_step=2, num_generations=4, beta=0.04,
                        rewards='[{name: "tests.posttrain.test_stages:digit_share"}]')
    assert main([stage, *quick(out, base, **settings)]) == 0
    exported = load_checkpoint(out / "final", dtype=torch.float32)
    rebuilt = merge_lora(load_adapter(load_checkpoint(base, dtype=torch.float32),
                                      out / "final-adapter"))
    ids = torch.randint(0, exported.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, rebuilt(ids).logits, atol=1e-2,
                                   rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(
        exported.state_dict().values(), load_checkpoint(base).state_dict().values(),
        strict=True))
