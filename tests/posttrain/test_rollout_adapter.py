"""GRPO under LoRA samples its rollouts from the policy's adapters in an engine slot: the
same completions, seeded, as from the adapters merged into a copy of the base."""

from __future__ import annotations

import time

import torch

from lathe.data.tokenizer import load_tokenizer
from lathe.model import load_checkpoint
from lathe.model.checkpoint import read_eos_ids
from lathe.model.lora import AdapterMerger, LoraSection, adapter_pairs, adapter_weights, apply_lora
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams


def test_slot_rollouts_equal_merged_rollouts(base):
    lora = LoraSection(enabled=True, r=8, alpha=16)
    policy = apply_lora(load_checkpoint(base), lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    weights = adapter_weights(policy)
    tokenizer, eos = load_tokenizer(base), read_eos_ids(base, policy.config.vocab_size)
    prompts = [tokenizer.encode(f"What is {a} + {a + 7}?").ids for a in range(12, 20)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=s, logprobs=0,
                             logprobs_at_temperature=True) for s in range(len(prompts))]

    slot = LLMEngine(load_checkpoint(base), tokenizer, EngineConfig(
        num_blocks=256, max_loras=1, max_lora_rank=lora.r), eos)
    merged = LLMEngine(load_checkpoint(base), tokenizer, EngineConfig(num_blocks=256), eos)
    merger = AdapterMerger(load_checkpoint(base), lora)
    start = time.perf_counter()
    slot.put_adapter("policy", adapter_pairs(weights), lora.scale)
    slot_refresh = time.perf_counter() - start
    start = time.perf_counter()
    merged.load_weights(merger(weights))
    merge_refresh = time.perf_counter() - start

    from_slot = slot.generate(prompts, params, adapter="policy")
    from_merge = merged.generate(prompts, params)
    for a, b in zip(from_slot, from_merge, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in x.logprobs]),
                                       torch.tensor([lp.logprob for lp in y.logprobs]),
                                       atol=1e-4, rtol=0)
    assert slot_refresh < merge_refresh  # no copy of the base is rebuilt
    # a new step's adapters replace the old ones; the prefix cache does not serve their KV
    slot.put_adapter("policy", adapter_pairs({k: v * 0 for k, v in weights.items()}),
                     lora.scale)
    plain = LLMEngine(load_checkpoint(base), tokenizer, EngineConfig(num_blocks=256), eos)
    assert [o.token_ids for d in slot.generate(prompts, params, adapter="policy")
            for o in d.outputs] == [o.token_ids for d in plain.generate(prompts, params)
                                   for o in d.outputs]
