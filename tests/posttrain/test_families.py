"""Post-training Qwen2, Gemma 2, Phi-3, Qwen3-MoE, GLM-4.5-MoE, Qwen3.5, Qwen3.5-MoE and
Qwen3-Next checkpoints that transformers wrote (with lathe's tokenizer, whose chat template
the stages render): SFT and DPO steps with LoRA run, and the merged export loads in
transformers as the original class with lathe's logits; the adapter folder loads in peft on
that class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.data.tokenizer import load_tokenizer
from lathe.model import load_checkpoint
from lathe.model.checkpoint import TOKENIZER_FILES, CheckpointError
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams
from tests.posttrain.conftest import quick
from tests.posttrain.test_stages import preference_files

transformers = pytest.importorskip("transformers")


FAMILY_CONFIGS = {
    "Qwen2": {},
    # every other layer slides over 16 tokens, scores and logits soft-capped
    "Gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16},
    # q/k/v and gate/up stored fused: the adapter is written on qkv_proj and gate_up_proj
    "Phi3": {"sliding_window": 16},
    # a mixture of experts: adapters on attention and on the stacked experts (peft's
    # target_parameters, as on transformers' class), SFT's loss carrying the balance loss at
    # the checkpoint's coefficient as TRL's does (output_router_logits, which the export keeps)
    "Qwen3Moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "norm_topk_prob": True},
    # DeepSeek-V3's router (no balance loss), a dense first layer and a shared expert, which
    # the MLP targets adapt as the linears they are (transformers' `shared_experts`)
    "Glm4Moe": {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "n_group": 2, "topk_group": 1},
    # a Gated DeltaNet layer before a gated full-attention one: the engine that evaluates
    # and serves it carries each sequence's recurrent state
    "Qwen3_5": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "linear_key_head_dim": 8, "linear_value_head_dim": 8},
    # and with Qwen2-MoE's experts beside them: the expert adapters merged into GRPO's
    # rollout engine, which keeps the linear layers' states
    "Qwen3_5Moe": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    # Qwen3.5-MoE's layers stored as Qwen3-Next's (each DeltaNet's projections fused), its
    # experts where mlp_only_layers leaves them: the adapter written on the class's modules
    "Qwen3Next": {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                  "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "mlp_only_layers": [0]},
}
# a family whose text model's config class is not `<family>Config` (that is its wrapper's)
CONFIG_CLASSES = {"Qwen3_5": "Qwen3_5TextConfig", "Qwen3_5Moe": "Qwen3_5MoeTextConfig"}
EXPERTS = {"Qwen3Moe": "model.layers.0.mlp.experts.gate_up_proj",
           "Qwen3_5Moe": "model.layers.0.mlp.experts.gate_up_proj",
           "Qwen3Next": "model.layers.1.mlp.experts.gate_up_proj",
           "Glm4Moe": "model.layers.1.mlp.experts.gate_up_proj"}


@pytest.fixture(scope="module", params=FAMILY_CONFIGS)
def family_base(request, base, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    folder = tmp_path_factory.mktemp(family) / "base"
    tokenizer = load_tokenizer(base)
    eos = tokenizer.token_to_id("<|end_of_turn|>")
    config = getattr(transformers, CONFIG_CLASSES.get(family, f"{family}Config"))(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        eos_token_id=eos, bos_token_id=tokenizer.token_to_id("<|begin_of_text|>"),
        pad_token_id=0, **FAMILY_CONFIGS[family])
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)
    return family, folder


def logits_agree(folder: Path, ids: torch.Tensor, family: str) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(theirs).__name__ == f"{family}ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(folder)(ids).logits,
                                   theirs.eval()(ids).logits, atol=1e-4, rtol=1e-4)


def test_sft_and_dpo_with_lora_on_a_foreign_checkpoint(family_base, tmp_path):
    from peft import PeftModel
    family, family_base = family_base
    ids = torch.randint(0, 300, (1, 40))
    sft = tmp_path / "sft"
    assert main(["sft", *quick(sft, family_base, max_steps=2, **{"lora.enabled": "true",
                                                               "optim.lr": 3e-3,
                                                               "data.limit": 64})]) == 0
    logits_agree(sft / "final", ids, family)
    softmax_routed = family in ("Qwen3Moe", "Qwen3_5Moe", "Qwen3Next")
    if softmax_routed:  # the switch TRL's SFT sets too
        assert transformers.AutoConfig.from_pretrained(sft / "final").output_router_logits
    base = transformers.AutoModelForCausalLM.from_pretrained(family_base, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, sft / "final-adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, load_checkpoint(sft / "final")(ids).logits,
                                   atol=1e-4, rtol=1e-4)
    # the serving engine takes the adapter folder over the base as the merged checkpoint
    engine = LLMEngine.from_checkpoint(family_base, EngineConfig(num_blocks=64, max_loras=1,
                                                                 max_lora_rank=64))
    if family in EXPERTS:  # the experts were adapted too: merged, not in a slot
        experts = EXPERTS[family]
        assert not torch.equal(load_checkpoint(sft / "final").state_dict()[experts],
                               load_checkpoint(family_base).state_dict()[experts])
        with pytest.raises(CheckpointError, match="adapter slots do not serve"):
            engine.add_adapter("sft", sft / "final-adapter")
        # GRPO's rollout engine takes the merged weights each step instead of a slot
        grpo = tmp_path / "grpo"
        assert main(["grpo", *quick(grpo, family_base, max_steps=2, prompts_per_step=2,
                                    num_generations=2, limit=16, **{"lora.enabled": "true"})]) == 0
        logits_agree(grpo / "final", ids, family)
        # GRPO's loss carries the balance loss of a softmax router's experts, as TRL's does
        logged = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
        balance = [record["router/aux_loss"] for record in logged if "router/aux_loss" in record]
        assert len(balance) == 2 if softmax_routed else not balance
        return
    engine.add_adapter("sft", sft / "final-adapter")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = ids[0, :20].tolist()
    assert engine.generate([prompt], params, adapter="sft")[0].outputs[0].token_ids == \
        LLMEngine.from_checkpoint(sft / "final", EngineConfig(num_blocks=64)).generate(
            [prompt], params)[0].outputs[0].token_ids

    files = preference_files(tmp_path)
    dpo = tmp_path / "dpo"
    assert main(["dpo", *quick(dpo, sft / "final", max_steps=2, **{
        "lora.enabled": "true", "data.train": files["train"], "data.eval": files["test"]})]) == 0
    logits_agree(dpo / "final", ids, family)
    if family == "Qwen3_5":  # GRPO's rollouts: its engine's recurrent states, adapters in slots
        grpo = tmp_path / "grpo"
        assert main(["grpo", *quick(grpo, family_base, max_steps=2, prompts_per_step=2,
                                    num_generations=2, limit=16, **{"lora.enabled": "true"})]) == 0
        logits_agree(grpo / "final", ids, family)
