"""Distillation (`lathe distill` / `accelerate launch -m lathe.posttrain.distill`): move a
teacher's behaviour into a student that shares its tokenizer.

Three modes. `logits`: on chat data, the student matches the teacher's next-token
distributions on assistant tokens — forward KL, reverse KL or generalized JSD at a
temperature — mixed with the ordinary cross-entropy by `ce_weight`. `teacher_data`: the
teacher answers a prompt set with the serve engine, the answers are written as a chat
dataset, and the student is SFT-trained on it. `on_policy` (`distill_on_policy`): the
student samples its own answers and matches the teacher on them. All end by reporting
student and teacher accuracy on the held-out task.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lathe.core.atomic import write_json
from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder, chat_encoder
from lathe.data.formats import load_prompt_dataset
from lathe.data.mixture import load_rows
from lathe.data.tokenizer import load_tokenizer, vocabulary_difference
from lathe.model.checkpoint import OpenCheckpoint, read_model_config
from lathe.model.config import ModelConfig
from lathe.model.transformer import IGNORE_INDEX, routing_metrics
from lathe.posttrain import distill_on_policy
from lathe.posttrain.chats import chat_shape, chat_work, collate, start_chat_run
from lathe.posttrain.common import (
    TaskEvaluator,
    evaluate_task,
    finish_stage,
    load_policy,
    percent,
    rank_batches,
    real_tokens,
    stage_history,
    stage_main,
    stage_model,
    train_on_batches,
)
from lathe.posttrain.config import DistillConfig, PosttrainConfig, SFTConfig
from lathe.posttrain.divergence import DistillationLoss, check_vocabularies, teacher_rows
from lathe.posttrain.sft import sft
from lathe.posttrain.tool_episodes import EpisodeRunner
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape, frozen_weight_bytes
from lathe.pretrain.runtime.trainer import Runtime, Work
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams


def check_same_tokenizer(student: str, teacher: str) -> None:
    differ = vocabulary_difference(load_tokenizer(student), load_tokenizer(teacher))
    if differ:
        raise ConfigError(f"teacher {teacher} and student {student} must share a tokenizer "
                          f"(their vocabularies differ, e.g. {differ}); distill between "
                          "models trained with the same tokenizer.json")


def step_shape(config: DistillConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None) -> StepShape:
    """One micro-batch of logit distillation, for memory plans: the student's, beside the
    teacher's weights as `Runtime.prepare_frozen` places them (teacher_data mode trains
    with SFT's shape)."""
    if config.mode == "on_policy":
        return distill_on_policy.step_shape(config, parallelism, model_config)
    model_config = model_config or read_model_config(config.model)
    if config.mode != "logits":
        return chat_shape(config, model_config, parallelism)
    return chat_shape(config, model_config, parallelism, frozen_weight_bytes(
        read_model_config(config.teacher), parallelism))


def distill_logits(config: DistillConfig, teacher_checkpoint: OpenCheckpoint,
                   resume: str) -> dict[str, Any]:
    runtime = Runtime(config, stage="distill")
    model, encoder = load_policy(runtime, config)
    teacher = stage_model(runtime, teacher_checkpoint)
    check_vocabularies(model, teacher)
    model_config = model.config
    run = start_chat_run(runtime, config, model, encoder, resume,
                         step_shape(config, runtime.parallelism, model_config))
    teacher = runtime.prepare_frozen(teacher)
    student_work = chat_work(model_config)

    def work_of(batch: dict[str, Any]) -> Work:  # plus the teacher's forward (1/3 of a step)
        work = student_work(batch)
        return replace(work, flops=work.flops * 4 / 3)

    def loss_fn(m: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        ids, labels, documents = batch["ids"], batch["labels"], batch.get("documents")
        op = DistillationLoss(labels, teacher_rows(runtime, teacher, ids, documents), config)
        out = m(ids, labels=labels, documents=documents, head_op=op,
                token_mask=real_tokens(batch))
        return out.loss, {"loss": out.loss, **op.parts,
                          **routing_metrics(out.router)}

    # the held-out figure: KL(teacher ‖ student) at T=1 whatever the training loss
    kl_only = dataclasses.replace(config, loss="forward_kl", temperature=1.0, ce_weight=0.0)

    @torch.no_grad()
    def heldout_kl() -> float:
        runtime.model.eval()
        sums = torch.zeros(2, device=runtime.device)
        for rows, counts in rank_batches(run.heldout, config.micro_batch_size, runtime.rank,
                                         runtime.world_size):
            batch = collate(rows, run.pad_token, runtime.device)
            ids, labels = batch["ids"], batch["labels"]
            labelled = (labels[:, 1:] != IGNORE_INDEX).sum() * counts
            op = DistillationLoss(labels, teacher_rows(runtime, teacher, ids), kl_only)
            kl = runtime.model(ids, head_op=op).head
            sums += torch.stack([kl * labelled, labelled.float()])
        runtime.model.train()
        sums = runtime.accelerator.reduce(sums, reduction="sum")
        return float(sums[0] / sums[1])

    history = stage_history(run.restored, "kl_to_teacher")
    kls = history["kl_to_teacher"]
    if run.restored is None:
        kls.append(heldout_kl())
        runtime.log({"eval/kl_to_teacher": kls[-1]})  # the report's start value
        runtime.print(f"distill ({config.loss}, T={config.temperature}): held-out KL(teacher ‖ "
                      f"student) {kls[-1]:.4f}")

    def evaluate() -> bool:
        kls.append(heldout_kl())
        runtime.log({"eval/kl_to_teacher": kls[-1]})
        runtime.print(f"step {runtime.step}: held-out KL to teacher {kls[-1]:.4f}")
        return False  # task accuracy is measured once, after training

    train_on_batches(runtime, config, run.batches, run.collate, loss_fn, work_of, evaluate,
                     history)
    evaluator = TaskEvaluator(config.task_eval, config.model, encoder,
                              EpisodeRunner(encoder, config.tools))
    student_accuracy = evaluate_task(runtime, evaluator, config.lora)
    summary = finish_stage(runtime, config, model_config, history, ["kl_to_teacher"],
                           {"sources": run.contributed()})
    return {**summary, "student_accuracy": student_accuracy}


def write_teacher_data(config: DistillConfig, teacher: OpenCheckpoint,
                       encoder: ChatEncoder, path: Path) -> int:
    """The teacher's greedy answers to the training prompts, prompted through its own chat
    template (`encoder`), as a chat .jsonl (atomically)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(teacher.model(device=device), encoder.tokenizer,
                       EngineConfig(num_blocks=1024, retain_freed_memory=False),
                       teacher.eos_ids)
    data = config.data
    rows, _ = load_rows(data.train, load_prompt_dataset, "train", data.limit, config.seed)
    prompts = [encoder.prompt(row.prompt, row.tools) for row in rows]
    params = SamplingParams(max_tokens=config.max_completion_tokens, temperature=0)
    answers = engine.generate(prompts, params, progress=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row, answer in zip(rows, answers, strict=True):
            record = {"messages": [*row.prompt, {
                "role": "assistant", "content": answer.outputs[0].text.strip()}]}
            f.write(json.dumps(record | ({"tools": row.tools} if row.tools else {})) + "\n")
    tmp.replace(path)
    return len(rows)


def distill(config: DistillConfig, resume: str = "never") -> dict[str, Any]:
    check_same_tokenizer(config.model, config.teacher)
    # opened once: the teacher trains the student and is scored after, from one read
    teacher = OpenCheckpoint(config.teacher)
    teacher_encoder = chat_encoder(config.teacher)
    if config.mode == "logits":
        summary = distill_logits(config, teacher, resume)
    elif config.mode == "on_policy":
        summary = distill_on_policy.distill_on_policy(config, teacher, resume)
    else:
        out = Path(config.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        data_file = out / "teacher_data.jsonl"
        if not data_file.is_file():
            answered = write_teacher_data(config, teacher, teacher_encoder, data_file)
            print(f"teacher {config.teacher} answered {answered} prompts -> {data_file}")
        shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(PosttrainConfig)}
        sft_config = SFTConfig(**shared,
                               data=dataclasses.replace(config.data, train=str(data_file)))
        result = sft(sft_config, resume)
        summary = {**result, "student_accuracy": result["accuracy"][-1]}
    if os.environ.get("RANK", "0") != "0":  # the report is the main process's job
        return summary
    evaluator = TaskEvaluator(config.task_eval, config.teacher, teacher_encoder,
                              EpisodeRunner(teacher_encoder, config.tools))
    summary["teacher_accuracy"] = evaluator(teacher.model())["accuracy"]
    write_json(Path(config.out_dir) / "summary.json", summary)
    print(f"done: distill ({config.mode}); held-out {config.task_eval.task} accuracy: student "
          f"{percent(summary['student_accuracy'])}, teacher "
          f"{percent(summary['teacher_accuracy'])}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("distill", "Distill a teacher into a student sharing its tokenizer: "
                      "--mode=logits (KL/JSD on chat data), --mode=teacher_data (SFT on "
                      "the teacher's answers) or --mode=on_policy (KL/JSD on the student's "
                      "own samples).", DistillConfig, distill, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("distill", sys.argv[1:]))
