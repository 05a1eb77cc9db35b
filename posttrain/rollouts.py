"""The rollout side of on-policy training (GRPO, on-policy distillation): prompts rendered
and fitted, the serve engine on its own copy of the policy sampling episodes and scoring
them, the policy's weights carried to every rank's engine after each step, and rollouts
collated into training batches."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch import Tensor

from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import PromptRow
from lathe.model.checkpoint import OpenCheckpoint
from lathe.model.config import ModelConfig
from lathe.model.lora import (
    AdapterMerger,
    LoraSection,
    adapter_pairs,
    adapter_weights,
    has_experts,
)
from lathe.model.transformer import IGNORE_INDEX, Transformer
from lathe.posttrain.common import PromptFit, pad
from lathe.posttrain.config import RewardSpec, RolloutConfig
from lathe.posttrain.reward_model import RewardModelScorer
from lathe.posttrain.rewards import Reward, load_reward, verifier
from lathe.posttrain.tool_episodes import Episode, EpisodePrompt, EpisodeRunner
from lathe.pretrain.runtime.precision import compute_dtype
from lathe.pretrain.runtime.trainer import Runtime
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.paged_cache import engine_cache_bytes
from lathe.serve.remote import LocalServer, RemoteEngine
from lathe.serve.sampling_params import SamplingParams


@dataclass
class Prompt:
    row: PromptRow
    ids: list[int]  # the rendered chat, fitted to max_prompt_length


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]  # the model's tokens, and with tools the results' between turns
    reward: float
    correct: float
    sampled_logps: list[float]  # the engine's, at the sampling temperature
    policy: list[bool]  # which completion tokens the model sampled (the rest carry no loss)
    truncated: bool = False  # cut at max_completion_tokens
    masked: bool = False  # left out of the loss (overlong: filter)
    advantage: float = 0.0
    policy_version: int = 0  # the engine's weight version that sampled it (its oldest turn's)


def collate(rollouts: list[Rollout], pad_token: int, device: torch.device) -> dict[str, Any]:
    ids = pad([r.prompt_ids + r.completion_ids for r in rollouts], pad_token).to(device)
    labels = pad([[IGNORE_INDEX] * len(r.prompt_ids) + [
        token if sampled and not r.masked else IGNORE_INDEX for token, sampled in zip(
            r.completion_ids, r.policy, strict=True)] for r in rollouts], IGNORE_INDEX).to(device)
    sampled = pad([[0.0] * len(r.prompt_ids) + r.sampled_logps for r in rollouts], 0.0)
    return {"ids": ids, "labels": labels, "mask": labels[:, 1:] != IGNORE_INDEX,
            "sampled": sampled[:, 1:].to(device),
            "lengths": [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts],
            "advantages": torch.tensor([r.advantage for r in rollouts], device=device)}


def fit_prompts(encoder: ChatEncoder, rows: list[PromptRow], fit: PromptFit,
                tools: list[dict[str, Any]] | None = None) -> list[Prompt]:
    """Each row rendered with its tools (or `tools`, the stage's, when it has none) and
    fitted; rows that do not fit are dropped or cut as `fit` says."""
    prompts = []
    for row in rows:
        row = dataclasses.replace(row, tools=row.tools or tools)
        ids = fit(encoder.prompt(row.prompt, row.tools))
        if ids is not None:
            prompts.append(Prompt(row, ids))
    return prompts


ROLLOUT_BLOCKS = 1024  # the rollout engine's KV cache, in blocks of EngineConfig.block_size
POLICY_ADAPTER = "policy"  # the rollout engine's name for the policy's current adapters


def rollout_engine_bytes(model_config: ModelConfig, mixed_precision: str) -> tuple[int, int]:
    """What a rank's rollout engine holds, for memory plans: its fp32 copy of the policy, and
    its KV cache of ROLLOUT_BLOCKS blocks (with linear-attention layers, their states)."""
    cache = engine_cache_bytes(EngineConfig(num_blocks=ROLLOUT_BLOCKS), model_config,
                               compute_dtype(mixed_precision))
    return 4 * model_config.num_params(), cache


class RolloutGenerator:
    """The serve engine on its own copy of the policy (or a server's, `remote`, fed the
    policy's weights by pushes): `n` episodes per prompt (one turn
    each, or with tools turns that call them), scored by `rewards` (functions of each
    answer, and reward models of each whole conversation, batched) and checked by the
    `task`'s verifier. Under LoRA the engine keeps the
    full-precision base and serves the policy's current adapters from an adapter slot,
    refreshed each step without touching the base (LoRA on lm_head or a mixture of
    experts' experts, which slots do not take, merges into a copy of the base instead);
    never a merge into a 4-bit QLoRA base. A server likewise takes the adapters alone, each
    step's as a peft folder it loads under a name of its own (`policy-N`), where its slots
    take them; else the merged weights."""

    def __init__(self, opened: OpenCheckpoint, encoder: ChatEncoder, episodes: EpisodeRunner,
                 lora: LoraSection, rewards: list[RewardSpec], task: str,
                 device: torch.device, kv_dtype: torch.dtype,
                 remote: RolloutConfig | None = None, pushes: bool = True,
                 local_weights: str | Path = "rollout-weights") -> None:
        self.episodes, self.lora, self.model_config = episodes, lora, opened.config
        self.rewards = [(load_reward(r.name), r.weight) for r in rewards if r.name is not None]
        self.scorers = [(RewardModelScorer(r.model, device), r.weight)
                        for r in rewards if r.model is not None]
        self.correct = verifier(task)
        self.push_to: Path | None = None
        self.server: LocalServer | None = None
        self.version = 0  # the policy's weights handed to the engine so far (`refresh`)
        if remote is not None and remote.url is not None:
            self.adapter = None
            base = opened.model(dtype=torch.float32) if lora.enabled else None
            self.merger = AdapterMerger(base, lora) if base is not None else None
            # a LoRA policy's adapters alone, where the server's slots take them
            self.pushes_adapters = base is not None and slots_take(base, lora)
            self.base_path = opened.path
            url, key = remote.url, os.environ.get(remote.api_key_env)
            weights = Path(remote.weights_dir or local_weights)
            if url == "local":  # the main process starts it; every rank learns where
                if pushes:
                    weights.mkdir(parents=True, exist_ok=True)
                    # the in-process engine's cache, and off CUDA its eager steps: the
                    # server's compiles would take the trainer's cores for the whole run
                    # (README GRPO stage on 2 cores: 188 s against 95 s eager)
                    self.server = LocalServer(opened.path, weights, remote.timeout,
                                              lora.r if self.pushes_adapters else None,
                                              eager=device.type != "cuda",
                                              num_blocks=ROLLOUT_BLOCKS)
                address = [self.server.url, self.server.api_key] if self.server else [None, None]
                broadcast_object_list(address)
                url, key = address
            self.engine = RemoteEngine(url, opened.eos_ids, key, remote.model, remote.timeout,
                                       remote.concurrency, remote.max_retries)
            self.push_to = weights if pushes else None
            self.remote = True
            return
        self.remote = False
        model = opened.model(dtype=torch.float32, device=device)
        self.adapter = POLICY_ADAPTER if lora.enabled and slots_take(model, lora) else None
        self.merger = AdapterMerger(model, lora) if lora.enabled and self.adapter is None \
            else None
        slots = dict(max_loras=1, max_lora_rank=lora.r) if self.adapter is not None else {}
        engine_config = EngineConfig(num_blocks=ROLLOUT_BLOCKS, retain_freed_memory=False,
                                     **slots)
        self.engine = LLMEngine(model.eval(), encoder.tokenizer, engine_config, opened.eos_ids,
                                kv_dtype=kv_dtype)

    def close(self) -> None:
        """Stop the server this generator started, if any."""
        if self.server is not None:
            self.server.stop()

    def refresh(self, weights: dict[str, Tensor]) -> None:
        """Take the policy's gathered weights (its adapters alone under LoRA); a server's
        engine gets them pushed, by the rank that pushes."""
        self.version += 1
        if self.remote and self.pushes_adapters:
            name = f"{POLICY_ADAPTER}-{self.version}"
            if self.push_to is not None:
                folder = self.merger.write_adapter(weights, self.push_to / name, self.base_path)
                self.engine.push_adapter(folder, name)
            self.adapter = name  # every rank's requests name it (they wait for the push)
        elif self.remote:
            if self.push_to is not None:
                self.engine.push(self.merger(weights) if self.merger is not None else weights,
                                 self.model_config, self.push_to)
        elif self.adapter is not None:
            self.engine.put_adapter(self.adapter, adapter_pairs(weights), self.lora.scale)
        else:
            self.engine.load_weights(self.merger(weights) if self.merger is not None
                                     else weights)

    def __call__(self, prompts: list[Prompt], params: SamplingParams, seed: int,
                 first: int = 0) -> tuple[list[Rollout], dict[str, float]]:
        """The rollouts of `prompts` sampled with `params` (at least logprobs=0), the step's
        from its `first`-th on (each prompt seeded by its index in the step, whichever rank
        samples it), and their episodes' tool metrics."""
        per_prompt = [dataclasses.replace(params, seed=seed + i * 1000)
                      for i in range(first, first + len(prompts))]
        groups = self.episodes.run(self.engine, [EpisodePrompt(p.ids, p.row.prompt, p.row.tools)
                                                 for p in prompts], per_prompt, self.adapter)
        rollouts, episodes = [], [e for group in groups for e in group]
        for prompt, group in zip(prompts, groups, strict=True):
            reference = prompt.row.reference
            rollouts += [Rollout(prompt.ids, e.completion_ids,
                                 episode_reward(self.rewards, e, reference),
                                 self.correct(e.answer, reference), e.logprobs, e.policy,
                                 e.finish_reason == "length",
                                 policy_version=e.policy_version or 0) for e in group]
        tools = [p.row.tools for p, group in zip(prompts, groups, strict=True) for _ in group]
        for scorer, weight in self.scorers:
            for rollout, score in zip(rollouts, scorer([e.messages for e in episodes], tools),
                                      strict=True):
                rollout.reward += weight * score
        metrics = {}
        if self.episodes.tools is not None:
            n = len(episodes)
            metrics = {"tools/calls_per_episode": sum(e.tool_calls for e in episodes) / n,
                       "tools/errors_per_episode": sum(e.tool_errors for e in episodes) / n,
                       "tools/turns_per_episode": sum(e.turns for e in episodes) / n,
                       "tools/unfinished": sum(e.finish_reason != "stop" for e in episodes) / n}
        return rollouts, metrics


def slots_take(model: Transformer, lora: LoraSection) -> bool:
    """Whether a serving engine's adapter slots take this LoRA: not on lm_head, not on a
    mixture of experts' stacked expert parameters."""
    return "lm_head" not in lora.target_modules and not (
        has_experts(model) and lora.expert_parameters())


def episode_reward(rewards: list[tuple[Reward, float]], episode: Episode,
                   reference: str) -> float:
    """The weighted sum of `rewards` on the episode's answer; a reward that takes
    `messages` is also given the whole episode's (its tool calls and results)."""
    return sum(weight * reward(episode.answer, reference, **(
        {"messages": episode.messages} if _takes_messages(reward) else {}))
        for reward, weight in rewards)


@functools.cache
def _takes_messages(reward: Reward) -> bool:
    try:
        return "messages" in inspect.signature(reward).parameters
    except (TypeError, ValueError):
        return False


def engine_weights(runtime: Runtime, lora: LoraSection) -> dict[str, Tensor]:
    """What every rank's rollout engine needs from the policy (collective): the full
    weights, or under LoRA the adapter weights only — each rank's own where it holds them
    whole, else gathered from the shards on the main process and broadcast."""
    model = runtime.accelerator.unwrap_model(runtime.model)
    if lora.enabled and not runtime.sharded:
        return adapter_weights(model)
    state = runtime.accelerator.get_state_dict(runtime.model)
    if runtime.is_main or not runtime.shards_weights:
        state = {k: v.detach().clone() for k, v in state.items()
                 if not lora.enabled or ".lora_" in k}
    if runtime.shards_weights:
        state = broadcast_state(state if runtime.is_main else None, runtime.device)
    return state


def broadcast_state(state: dict[str, Tensor] | None, device: torch.device) -> dict[str, Tensor]:
    """The main process's `state` on every rank (collective): names, shapes and dtypes as one
    object, then each tensor through the launch's own collective (on `device`: NCCL moves
    only device tensors), returned on the CPU."""
    meta = [None if state is None else [(k, v.shape, v.dtype) for k, v in state.items()]]
    broadcast_object_list(meta)
    out = {}
    for name, shape, dtype in meta[0]:
        tensor = state[name].to(device) if state is not None else torch.empty(
            shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=0)
        out[name] = tensor.cpu()
    return out
