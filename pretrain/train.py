"""Pretraining (`lathe pretrain` / `accelerate launch -m lathe.pretrain`): a Llama-shaped
model trained from scratch on packed token shards, on the shared runtime.

Read top to bottom: config -> runtime -> data -> model -> loop (train step, logging,
evaluation, checkpoint) -> export -> summary. Parallelism, precision and resume all live
in the runtime; this file is only what is specific to next-token pretraining.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lathe.core.atomic import write_json
from lathe.core.config import load_config, to_dict
from lathe.core.errors import ConfigError
from lathe.core.failpoints import failpoint
from lathe.data.loader import PackedLoader, window_documents
from lathe.data.tokenizer import load_tokenizer, token_byte_lengths
from lathe.model.config import ModelConfig
from lathe.model.transformer import Transformer, routing_metrics
from lathe.pretrain.config import PretrainConfig
from lathe.pretrain.evaluate import sample_continuations, validation_metrics
from lathe.pretrain.expert_balance import ExpertBiasBalancer
from lathe.pretrain.runtime.memory_plan import StepShape, memory_line
from lathe.pretrain.runtime.trainer import Runtime, Work


def lm_loss(model: nn.Module, batch: Tensor, z_loss: float, separator: int | None = None,
            balancer: ExpertBiasBalancer | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Next-token cross-entropy on a (B, T + 1) window batch, plus optional z-loss
    (PaLM: z_loss · mean(logsumexp(logits)²) keeps the softmax normalizer near 1). With a
    `separator` (document masking) each document of a window attends only to itself; the
    token before a separator still predicts it, as the end of its document. A mixture of
    experts' loss carries its router losses, and its router statistics are logged (and
    counted by the `balancer`, when its selection biases are being balanced).

    The whole window goes in with itself as labels; the head and the loss are computed
    together chunk by chunk (`lathe.kernels.linear_cross_entropy`: the (B·T × vocab) logits
    never exist); the last position's hidden state is computed and dropped, which is
    causal-safe.
    """
    documents = None if separator is None else window_documents(batch, separator)
    out = model(batch, labels=batch, return_logits=False, z_loss=z_loss, documents=documents)
    metrics = {"loss": out.loss, **routing_metrics(out.router)}
    if balancer is not None:
        balancer.observe(out.router)
    if z_loss:  # the logged loss stays the cross-entropy (with router losses)
        metrics.update(loss=out.loss.detach() - z_loss * out.z, z_loss=out.z)
    return out.loss, metrics


def pretrain(config: PretrainConfig, resume: str = "never") -> dict[str, Any]:
    """Run (or continue) a pretraining run; returns its summary (also in summary.json)."""
    runtime = Runtime(config, stage="pretrain")
    tokenizer = load_tokenizer(config.data.tokenizer)
    model_config = config.model.build(tokenizer.get_vocab_size(with_added_tokens=True))
    seq_len = config.data.seq_len
    if seq_len > model_config.max_seq_len:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's max_seq_len="
                          f"{model_config.max_seq_len}; lower data.seq_len or raise "
                          "model.overrides.max_seq_len")

    def loader(split: str, seed: int) -> PackedLoader:
        return PackedLoader(config.data.shards, split, config.micro_batch_size, seq_len,
                            seed=seed, rank=runtime.rank, world_size=runtime.world_size)

    train_loader = loader("train", config.seed)
    separator = train_loader.separator if config.data.document_mask else None
    if config.data.document_mask and separator is None:
        raise ConfigError(f"data.document_mask=true, but {config.data.shards} records no "
                          "bos_token_id to find documents by; rewrite the shards with "
                          "`lathe shards` or set data.document_mask=false")
    balancer = None
    if config.router_bias_update_speed:
        if not model_config.sigmoid_router:
            raise ConfigError(
                f"router_bias_update_speed={config.router_bias_update_speed}: family="
                f"{model_config.family!r} routes by softmax, with no selection bias to move; "
                "pretrain a glm4_moe model (DeepSeek-V3's router) or balance with "
                "model.overrides.router_aux_loss_coef")
        balancer = ExpertBiasBalancer(config.router_bias_update_speed)
    tokens_per_step = (config.micro_batch_size * config.grad_accum_steps
                       * runtime.world_size * seq_len)
    total_steps = config.total_steps(tokens_per_step, model_config.num_params())

    torch.manual_seed(config.seed)
    model = runtime.build_model(model_config, lambda: Transformer(model_config))
    runtime.prepare(model, total_steps, step_shape(config))
    restored = runtime.start(config, resume)
    last_eval: dict[str, float] = {}
    if restored is not None:
        train_loader.load_state_dict(restored["loader"])
        last_eval = restored.get("last_eval", {})
        runtime.print(f"resumed from step {runtime.step} ({runtime.tokens_seen:,} tokens)")
    runtime.print(_banner(runtime, model_config, total_steps, tokens_per_step, train_loader))

    byte_lengths = token_byte_lengths(tokenizer)
    flops_per_token = model_config.flops_per_token(seq_len)

    def window_work(batch: Tensor) -> Work:  # (B, T + 1) windows: B·T predicted tokens
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return Work(units=tokens, tokens=tokens, flops=tokens * flops_per_token)

    while runtime.step < total_steps:
        batches = [train_loader.next_batch().to(runtime.device)
                   for _ in range(config.grad_accum_steps)]
        result = runtime.train_step(
            batches, lambda m, b: lm_loss(m, b, config.precision.z_loss, separator, balancer),
            window_work)
        if balancer is not None:
            balancer.update(runtime.accelerator.unwrap_model(runtime.model),
                            lambda t: runtime.accelerator.reduce(t, reduction="sum"))
        runtime.log_step(result)
        if runtime.should(config.eval.every):
            last_eval = validation_metrics(runtime.model, loader("val", seed=0),
                                           config.eval.batches, byte_lengths,
                                           runtime.accelerator, separator)
            runtime.log(last_eval)
            failpoint("eval", runtime.step, runtime.rank)
            samples = sample_continuations(
                runtime.accelerator.unwrap_model(runtime.model), tokenizer,
                config.eval.sample_prompts, config.eval.sample_tokens, seq_len,
                kv_dtype=runtime.compute_dtype, temperature=config.eval.sample_temperature,
                top_k=config.eval.sample_top_k, seed=config.seed)
            runtime.metrics.log_texts("samples", samples, runtime.step)
            runtime.print(f"step {runtime.step}: val loss {last_eval['val/loss']:.4f}, "
                          f"bpb {last_eval['val/bpb']:.4f}; "
                          + " | ".join(f"{p!r} -> {c!r}" for p, c in samples))
        if runtime.should(config.checkpoint.every):
            runtime.save({"loader": train_loader.state_dict(), "last_eval": last_eval})

    memory = runtime.memory_report()  # the steps' peak, before the export gathers weights
    final = Path(config.out_dir) / "final"
    runtime.export(model_config, final, Path(config.data.tokenizer), {
        "config": to_dict(config), "data": config.data.shards, "final_metrics": last_eval})
    seconds = runtime.finish()
    summary = {"steps": runtime.step, "seed": config.seed, "tokens_seen": runtime.tokens_seen,
               "parameters": model_config.num_params(), "seconds": round(seconds, 1),
               "final": str(final), "parallel": runtime.setup,
               "converters": runtime.converters, "peak_flops_source": runtime.peak_source,
               "memory": memory, **last_eval}
    if runtime.is_main:
        write_json(Path(config.out_dir) / "summary.json", summary)
        print(_summary_text(summary, config.out_dir))
    return summary


def step_shape(config: PretrainConfig) -> StepShape:
    """One micro-batch of pretraining: windows of data.seq_len tokens, mean cross-entropy."""
    return StepShape(config.micro_batch_size, config.data.seq_len, "loss",
                     config.grad_accum_steps, packed=config.data.document_mask)


def _banner(runtime: Runtime, model_config: ModelConfig, total_steps: int, tokens_per_step: int,
            train_loader: PackedLoader) -> str:
    setup = runtime.setup
    epochs = total_steps * tokens_per_step / max(train_loader.tokens_per_epoch, 1)
    return (f"pretrain: {model_config.num_params() / 1e6:.2f}M parameters, "
            f"{setup['distributed_type']} × {setup['num_processes']} on {setup['device']} "
            f"({setup['mixed_precision']}), {total_steps} steps × {tokens_per_step:,} tokens "
            f"= {total_steps * tokens_per_step / 1e6:.2f}M tokens ({epochs:.2f} epochs)")


def _summary_text(summary: dict[str, Any], out_dir: str) -> str:
    loss = summary.get("val/loss", math.nan)
    bpb = summary.get("val/bpb", math.nan)
    return (f"done: {summary['steps']} steps, {summary['tokens_seen']:,} tokens in "
            f"{summary['seconds']:.0f}s; val loss {loss:.4f}, val bpb {bpb:.4f}; "
            f"{memory_line(summary['memory'])}\n"
            f"checkpoint: {summary['final']}   metrics: {out_dir}/metrics.jsonl   "
            f"summary: {out_dir}/summary.json")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe pretrain",
        description="Pretrain on token shards. Any config field can be overridden with "
                    "--dotted.key=value, e.g. --optim.lr=1e-3 --max_steps=200. Multi-process: "
                    "accelerate launch --config_file recipes/accelerate/X.yaml -m lathe.pretrain")
    parser.add_argument("--config", type=Path, help="YAML recipe, e.g. recipes/pretrain/tiny.yaml")
    parser.add_argument("--resume", default="never",
                        help="never (default), auto (newest state in out_dir), or a state folder")
    args, rest = parser.parse_known_args(argv)
    config = load_config(PretrainConfig, args.config, rest)
    pretrain(config, resume=args.resume)
    return 0
