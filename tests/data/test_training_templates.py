"""A checkpoint carrying a family's real chat template (TRL's copies: Qwen2.5, Qwen3, Llama
3, Gemma 3, Phi-3.5, GLM-4.5) trains through its training version: ids and assistant masks
equal transformers' `return_assistant_tokens_mask` on that version, for multi-turn,
reasoning and tool chats the original cannot mask; prompts still render through the
original, as the served model's do. Llama 3.1 and 3.2, which TRL has no training version of,
derive their masks from the original."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest

from lathe.data.chat_encoding import chat_encoder
from lathe.data.formats import Chat
from lathe.data.training_templates import training_template
from tests.builders import build_qwen_tokenizer
from tests.data.test_chat_templates import (
    MULTI,
    MULTI_REASONING,
    NO_SYSTEM,
    SINGLE,
    TOOL_CHAT,
    TOOL_TURNS,
)

TEMPLATES = files("trl") / "chat_templates"
CASES = [
    ("qwen3", MULTI_REASONING), ("qwen3", TOOL_TURNS), ("qwen3", MULTI),
    ("qwen2_5", MULTI), ("qwen2_5", TOOL_CHAT),
    ("llama3", MULTI), ("gemma3", NO_SYSTEM), ("phi3_5", MULTI),
    ("glm4moe", TOOL_CHAT), ("glm4moe", MULTI),
]
SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


def checkpoint(folder: Path, template: str) -> Path:
    build_qwen_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        config | SPECIALS | {"chat_template": template}))
    return folder


def hf_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **SPECIALS)


@pytest.mark.parametrize(("name", "chat"), CASES, ids=[f"{n}-{c.where}" for n, c in CASES])
def test_a_known_template_trains_through_its_training_version(tmp_path, name, chat):
    original = (TEMPLATES / f"{name}.jinja").read_text()
    training = (TEMPLATES / f"{name}_training.jinja").read_text()
    folder = checkpoint(tmp_path, original)
    encoder = chat_encoder(folder)
    assert f"TRL's {name}_training version" in encoder.name
    hf = hf_tokenizer(folder)
    expected = hf.apply_chat_template(chat.messages, tools=chat.tools, chat_template=training,
                                      tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = encoder.conversation(chat)
    assert ids == list(expected["input_ids"])
    assert mask == [bool(m) for m in expected["assistant_masks"]] and any(mask)
    prompt = chat.messages[:-1]
    served = hf.apply_chat_template(prompt, tools=chat.tools, chat_template=original,
                                    tokenize=True, add_generation_prompt=True,
                                    return_dict=True)["input_ids"]
    assert encoder.prompt(prompt, chat.tools) == list(served)


def test_line_ends_and_outer_whitespace_do_not_hide_a_known_template():
    original = (TEMPLATES / "qwen3.jinja").read_text()
    found = training_template("\n" + original.replace("\n", "\r\n") + "  \n")
    assert found is not None and found[0] == "qwen3" and "{% generation %}" in found[1]
    assert training_template(original.replace("<|im_start|>", "<|start|>")) is None


def test_an_unknown_template_keeps_its_own_rendering(tmp_path):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    encoder = chat_encoder(checkpoint(tmp_path, template))
    assert "TRL" not in encoder.name
    ids, mask = encoder.conversation(Chat(SINGLE.messages, where="x"))
    assert any(mask)


def test_a_preference_pair_splits_through_the_training_version(tmp_path):
    """Qwen3's own template renders a reasoning history differently once a reply follows
    (it drops past reasoning), so the reply could not be split from it; its training
    version renders every turn as it was."""
    folder = checkpoint(tmp_path, (TEMPLATES / "qwen3.jinja").read_text())
    encoder = chat_encoder(folder)
    history, reply = MULTI_REASONING.messages[:3], MULTI_REASONING.messages[3:]
    prompt, completion = encoder.continuation(history, reply)
    hf = hf_tokenizer(folder)
    training = (TEMPLATES / "qwen3_training.jinja").read_text()
    whole = hf.apply_chat_template(history + reply, chat_template=training, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert prompt + completion == list(whole)[:len(prompt) + len(completion)]
    assert completion and completion[-1] == hf.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("name", ["llama3_1", "llama3_2"])
@pytest.mark.parametrize("chat", [MULTI, TOOL_CHAT, NO_SYSTEM], ids=lambda c: c.where)
def test_llama_3_1_and_3_2_train_without_a_training_version(tmp_path, name, chat):
    """TRL ships no training version of Llama 3.1's and 3.2's templates; they render each
    turn as it was when it was the last, so the masks derive from the original: exactly
    each assistant reply (a tool call's JSON included) and its <|eot_id|>."""
    folder = checkpoint(tmp_path, (TEMPLATES / f"{name}.jinja").read_text())
    encoder = chat_encoder(folder)
    assert "training version" not in encoder.name
    ids, mask = encoder.conversation(chat)
    spans, run = [], []
    for token, masked in zip(ids + [None], mask + [False], strict=True):
        if masked:
            run.append(token)
        elif run:
            spans.append(encoder.tokenizer.decode(run, skip_special_tokens=False))
            run = []
    replies = [m for m in chat.messages if m["role"] == "assistant"]
    expected = [(json.dumps({"name": m["tool_calls"][0]["function"]["name"],
                             "parameters": m["tool_calls"][0]["function"]["arguments"]})
                 if m.get("tool_calls") else m["content"].strip()) + "<|eot_id|>" for m in replies]
    assert spans == expected
