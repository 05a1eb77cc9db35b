"""What a post-training step optimizes, checked on one process: the gradient of a step is
the mean over all its loss units however they fall into micro-batches, and GRPO's
log-probs are those of the distribution the engine sampled from."""

from __future__ import annotations

import pytest
import torch

from lathe.model.checkpoint import load_checkpoint
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.chats import chat_work, collate
from lathe.posttrain.common import rank_batches
from lathe.posttrain.grpo import per_token_logps
from lathe.posttrain.sft import sft_loss
from lathe.pretrain.runtime.config import LoggingConfig, OptimConfig, TrainConfig
from lathe.pretrain.runtime.trainer import Runtime
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams
from tests.builders import reset_accelerate, tiny_model


def examples(count: int = 8) -> list[tuple[list[int], list[int]]]:
    """Chats of very different lengths and supervised spans, as real SFT data has."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        length = 6 + 9 * i % 41
        ids = torch.randint(3, 256, (length,), generator=g).tolist()
        start = length // (2 + i % 3)
        rows.append((ids, [IGNORE_INDEX] * start + ids[start:]))
    return rows


def one_step(tmp_path, micro_batches: list[list], accum: int) -> tuple[dict, float]:
    """The gradient one optimizer step applies (captured before AdamW sees it) and its loss;
    the step counts the real tokens and their FLOPs, never the padding."""
    reset_accelerate()
    config = TrainConfig(out_dir=str(tmp_path), grad_accum_steps=accum, max_steps=1,
                         optim=OptimConfig(grad_clip=None),
                         logging=LoggingConfig(report_to="none", progress=False))
    runtime = Runtime(config, stage="test")
    model = tiny_model(n_layers=2).train()
    runtime.prepare(model, total_steps=1)
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs) -> None:
        grads.update({n: p.grad.clone() for n, p in runtime.model.named_parameters()})

    runtime.optimizers[0].optimizer.register_step_pre_hook(capture)
    batches = [collate(rows, 0, runtime.device) for rows in micro_batches]
    result = runtime.train_step(batches, sft_loss, chat_work(model.config))
    lengths = [len(ids) for rows in micro_batches for ids, _ in rows]
    assert runtime.tokens_seen == runtime.throughput.tokens == sum(lengths)
    assert runtime.throughput.flops == sum(n * model.config.flops_per_token(n) for n in lengths)
    return grads, float(result.metrics["loss"])


def test_accumulated_step_equals_the_step_on_the_concatenated_batch(tmp_path):
    rows = examples()
    whole_grads, whole_loss = one_step(tmp_path / "whole", [rows], accum=1)
    split_grads, split_loss = one_step(tmp_path / "split", [rows[i:i + 2] for i in (0, 2, 4, 6)],
                                       accum=4)
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert whole_grads.keys() == split_grads.keys()
    worst = max((whole_grads[n] - split_grads[n]).abs().max().item() for n in whole_grads)
    assert worst < 1e-6
    # the mean of micro-batch means (what accumulation did before) is another gradient
    parts = [one_step(tmp_path / f"m{i}", [rows[i:i + 2]], accum=1)[0] for i in (0, 2, 4, 6)]
    naive = {n: sum(p[n] for p in parts) / 4 for n in whole_grads}
    scale = max(g.abs().max().item() for g in whole_grads.values())
    assert max((naive[n] - whole_grads[n]).abs().max().item() for n in naive) > 0.05 * scale


def test_grpo_log_probs_are_the_engines_at_the_sampling_temperature(base):
    """The trainer's log-probs of a sampled completion equal the engine's at temperature T
    (the distribution it sampled), as TRL divides logits by T; at T = 1 they would not."""
    model = load_checkpoint(base, dtype=torch.float32).eval()
    engine = LLMEngine.from_checkpoint(base, EngineConfig(num_blocks=64))
    prompt = engine.encode("Question: what is 2 + 3?")
    temperature = 0.6
    out = engine.generate([prompt], SamplingParams(
        max_tokens=12, temperature=temperature, seed=7, ignore_eos=True, logprobs=0,
        logprobs_at_temperature=True))[0].outputs[0]
    batch = {"ids": torch.tensor([prompt + out.token_ids]),
             "labels": torch.tensor([[IGNORE_INDEX] * len(prompt) + out.token_ids]),
             "lengths": [len(prompt) + len(out.token_ids)]}
    with torch.no_grad():
        trainer = per_token_logps(model, batch, temperature)[0][0, len(prompt) - 1:]
        plain = per_token_logps(model, batch)[0][0, len(prompt) - 1:]
    sampled = torch.tensor([lp.logprob for lp in out.logprobs])
    assert (trainer - sampled).abs().max().item() < 1e-4
    assert (plain - sampled).abs().max().item() > 1e-2


def test_every_rank_runs_as_many_heldout_batches_and_counts_each_item_once():
    """A sharded forward is collective: 5 items on 2 ranks in batches of 2 must give both
    ranks 2 batches, the stand-in one not counted, and every item counted exactly once."""
    shares = [rank_batches(list(range(5)), 2, rank, 2) for rank in (0, 1)]
    assert [len(s) for s in shares] == [2, 2]
    counted = [item for share in shares for rows, counts in share if counts for item in rows]
    assert sorted(counted) == [0, 1, 2, 3, 4]
    assert shares[1][1][1] is False
