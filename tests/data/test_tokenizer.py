"""BPE training: lossless round trips, digit groups, special tokens, and lathe's chat
template rendered by lathe as transformers' apply_chat_template renders it."""

from __future__ import annotations

import json

import pytest

from lathe.core.errors import ConfigError
from lathe.data.chat import BOS, END_OF_TURN, SPECIAL_TOKENS
from lathe.data.chat_template import ChatTemplate, ChatTemplateError
from lathe.data.tokenizer import (
    REPORT_FILE,
    compression,
    is_heldout,
    save_tokenizer,
    train_tokenizer,
)
from tests.data.corpus import prose

CODE = 'def f(x):\n\tif x > 10:\n\t\treturn {"k": [1, 2, 3]}  # ok\n    pass\r\n'
SAMPLES = [
    "naïve café, Ελληνικά, 日本語のテキスト, עברית, and ﬁ ligatures",
    "emoji 😀👩‍👩‍👧‍👦🇺🇸 and a ZWJ\u200d sequence",
    "  leading, trailing   \t\n\n\n   whitespace runs  \u00a0 ",
    CODE,
    "numbers 1234567890 and 3.14159 and 2026-11-22",
    "",
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [prose(i) for i in range(60)] + [CODE * 3] * 5
    return train_tokenizer(texts, vocab_size=600, show_progress=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_lossless(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_in_fixed_order(tokenizer):
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    ids = tokenizer.encode(BOS + "hi" + END_OF_TURN).ids
    assert ids[0] == 0 and ids[-1] == 1
    assert tokenizer.get_vocab_size() == 600


def test_digits_are_split_into_groups():
    texts = ["1234567 " * 50] * 5
    three = train_tokenizer(texts, vocab_size=300, show_progress=False)
    one = train_tokenizer(texts, vocab_size=300, max_digits=1, show_progress=False)
    assert three.encode("1234567").tokens == ["123", "456", "7"]
    assert one.encode("1234567").tokens == list("1234567")


def test_too_small_vocab_is_rejected():
    with pytest.raises(ConfigError, match="vocab-size"):
        train_tokenizer(["x"], vocab_size=200)


def test_chat_template_matches_apply_chat_template(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tokenizer, tmp_path / "tok", report={"ok": True})
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be terse.\n"},
         {"role": "user", "content": "What is 2+2? 🙂"},
         {"role": "assistant", "content": "4"},
         {"role": "user", "content": "  and  3+3?\n\n"}],
    ]
    template = ChatTemplate.from_checkpoint(tmp_path / "tok")
    for messages in conversations:
        for gen in (False, True):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert text == template.render(messages, add_generation_prompt=gen)
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
            assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert template.render(conversations[1][:3], add_generation_prompt=False) == (
        f"{BOS}<|system|>\nBe terse.\n{END_OF_TURN}<|user|>\nWhat is 2+2? 🙂{END_OF_TURN}"
        f"<|assistant|>\n4{END_OF_TURN}")
    assert hf.eos_token == END_OF_TURN and hf.bos_token == BOS
    assert json.loads((tmp_path / "tok" / REPORT_FILE).read_text()) == {"ok": True}
    with pytest.raises(ChatTemplateError,
                       match="role must be system, user, assistant or tool, got narrator"):
        template.render([{"role": "narrator", "content": "x"}])


def test_tool_chats_render_and_tokenize_as_transformers_does(tokenizer, tmp_path):
    """lathe's template with tools (listed in the system turn), an assistant's calls
    (after text, and several at once) and tool results, against `apply_chat_template`."""
    from transformers import AutoTokenizer

    from lathe.data.tools import load_tool

    save_tokenizer(tokenizer, tmp_path / "tok", report={"ok": True})
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    template = ChatTemplate.from_checkpoint(tmp_path / "tok")
    tools = [load_tool("calculator").definition,
             load_tool("tests.data.tools_for_tests:weather").definition]
    call = {"type": "function", "id": "c0",
            "function": {"name": "calculator", "arguments": {"expression": "382 + 247"}}}
    weather = {"type": "function", "function": {"name": "weather",
                                                "arguments": {"city": "Zürich"}}}
    conversations = [
        [{"role": "user", "content": "What is 382 + 247?"},
         {"role": "assistant", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c0", "content": "629"},
         {"role": "assistant", "content": "629"}],
        [{"role": "system", "content": "Be terse."},
         {"role": "user", "content": "Sum, and the weather?"},
         {"role": "assistant", "content": "Checking.", "tool_calls": [call, weather]},
         {"role": "tool", "content": "629"}, {"role": "tool", "content": "21"},
         {"role": "user", "content": "Thanks"}]]
    for messages in conversations:
        for gen in (False, True):
            text = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=gen)
            assert text == template.render(messages, gen, tools)
    text = template.render(conversations[1], False, tools)
    assert text.startswith(f"{BOS}<|system|>\nBe terse.\n\nTools:\n{{\"name\": \"calculator\"")
    assert ('<|assistant|>\nChecking.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "382 + 247"}}\n</tool_call>\n<tool_call>\n{"name": "weather", '
            '"arguments": {"city": "Zürich"}}\n</tool_call>' + END_OF_TURN) in text
    assert f"<|user|>\n<tool_response>\n21\n</tool_response>{END_OF_TURN}" in text
    assert template.render(conversations[0][:1], True, None) == (
        f"{BOS}<|user|>\nWhat is 382 + 247?{END_OF_TURN}<|assistant|>\n")


def test_heldout_split_is_stable_and_sized():
    texts = [prose(i, paragraphs=1) for i in range(2000)]
    held = [t for t in texts if is_heldout(t, 0.1)]
    assert 150 < len(held) < 250
    assert held == [t for t in texts if is_heldout(t, 0.1)]


def test_compression_counts_bytes_per_token(tokenizer):
    report = compression(tokenizer, ["héllo", "abc"])
    assert report["bytes"] == 9
    assert report["bytes_per_token"] == pytest.approx(9 / report["tokens"], abs=1e-4)
