"""Post-training through a chat template other than the checkpoint's: SFT on tool-calling
chats, DPO and GRPO render through `--chat_template FILE`, the export carries what was
trained on, and a template that gives no assistant mask stops the run at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.data.chat_template import ChatTemplate
from lathe.data.tasks import task_examples
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tests.data.chat_templates import CHATML, plain
from tests.posttrain.conftest import quick

TOOLS = [{"type": "function", "function": {"name": "add"}}]
LONG = {"data.max_len": 384}  # ChatML's tags are plain text to lathe's tokenizer: long chats


@pytest.fixture(scope="module")
def long_base(base, tmp_path_factory) -> Path:
    """The base checkpoint's tokenizer on a model with room for ChatML chats."""
    config = ModelConfig.from_preset("tiny", vocab_size=load_checkpoint(base).config.vocab_size,
                                     n_layers=2, max_seq_len=512)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(config), tmp_path_factory.mktemp("long") / "base",
                           tokenizer=base)


def tool_chats(path: Path, count: int) -> Path:
    """Arithmetic chats whose assistant calls `add`, reads its result and answers."""
    rows = []
    for row in task_examples("arithmetic", "train", count):
        a, op, b = row.prompt.removeprefix("What is ").removesuffix("?").split()
        call = {"type": "function", "function": {"name": "add", "arguments": json.dumps(
            {"a": int(a), "b": int(b) if op == "+" else -int(b)})}}
        rows.append({"tools": TOOLS, "messages": [
            {"role": "user", "content": row.prompt},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": row.reference},
            {"role": "assistant", "content": row.answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template_file(tmp_path: Path, template: str) -> Path:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return path


def exported_template(out: Path) -> str:
    config = json.loads((out / "final" / "tokenizer_config.json").read_text())
    assert not (out / "final" / "chat_template.jinja").exists()
    return config["chat_template"]


def test_sft_on_tool_chats_through_a_given_template_exports_it(long_base, tmp_path, capsys):
    chats, template = tool_chats(tmp_path / "tools.jsonl", 8), template_file(tmp_path,
                                                                            plain(CHATML))
    out = tmp_path / "sft"
    assert main(["sft", *quick(out, long_base, max_steps=2, micro_batch_size=2, **LONG, **{
        "data.train": chats, "data.eval": chats, "chat_template": template})]) == 0
    printed = capsys.readouterr().out
    assert f"chat_template='{template}'" in printed and "assistant tokens per chat" in printed
    assert json.loads((out / "summary.json").read_text())["data_fit"]["dropped"] == 0
    assert exported_template(out) == plain(CHATML)
    rendered = ChatTemplate.from_checkpoint(out / "final").render(
        [{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("assistant\n")


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_dpo_and_grpo_render_through_the_given_template(long_base, tmp_path, stage):
    out = tmp_path / stage
    settings = {"chat_template": template_file(tmp_path, plain(CHATML)), "micro_batch_size": 2}
    if stage == "dpo":
        settings |= LONG | {"data.limit": 16}  # reference log-probs are taken for each pair
    if stage == "grpo":
        settings |= {"prompts_per_step": 2, "num_generations": 2, "max_completion_tokens": 4,
                     "grad_accum_steps": 2, "limit": 16}
    assert main([stage, *quick(out, long_base, max_steps=1, **settings)]) == 0
    assert exported_template(out) == plain(CHATML)


# a template that writes every reply twice: in its turn and in a list of the replies at the
# top of the conversation, so no one place in the rendering is the reply's
REPLIES_FIRST = ("{{- 'replies:' }}"
                 "{%- for m in messages if m.role == 'assistant' %}{{- ' ' + m.content }}"
                 "{%- endfor %}{{- '\\n' }}"
                 "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")


def test_a_template_that_gives_no_mask_stops_sft_at_start(base, tmp_path, capsys):
    """A template that renders each reply in two places: an earlier assistant turn can be
    found neither by rendering turn by turn nor by replacing it with a marker."""
    chats = tmp_path / "multi.jsonl"
    turns = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]
    chats.write_text(json.dumps({"messages": turns}) + "\n")
    template = template_file(tmp_path, REPLIES_FIRST)
    assert main(["sft", *quick(tmp_path / "sft", base, max_steps=1, **{
        "data.train": chats, "chat_template": template})]) != 0
    error = capsys.readouterr().err
    assert f"{chats} line 1: chat_template='{template}' gives no assistant mask" in error
    assert "{% generation %}" in error and "--chat_template FILE" in error


def test_template_arguments_cannot_be_overridden(base, tmp_path, capsys):
    assert main(["sft", *quick(tmp_path / "sft", base, max_steps=1,
                               **{"chat_template_kwargs.messages": "[]"})]) != 0
    assert "chat_template_kwargs.messages: lathe sets 'messages' itself" in \
        capsys.readouterr().err
