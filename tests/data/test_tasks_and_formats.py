"""Embedded post-training tasks, chat tokenization masks and dataset-row validation."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lathe.core.errors import ConfigError
from lathe.data.chat import BOS, CHAT_TEMPLATE, END_OF_TURN
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.chat_template import ChatTemplate
from lathe.data.formats import (
    Chat,
    load_chat_dataset,
    load_preference_dataset,
    load_prompt_dataset,
    load_unpaired_dataset,
)
from lathe.data.tasks import task_examples
from lathe.data.tasks.arithmetic import arithmetic_preferences, extract_number
from lathe.data.tokenizer import train_tokenizer
from tests.data.chat_templates import trained_text
from tests.data.corpus import prose


def test_tasks_are_deterministic_disjoint_and_verifiable():
    train, test = task_examples("arithmetic", "train", 2000), task_examples("arithmetic", "test")
    assert train == task_examples("arithmetic", "train", 2000)
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    for row in train[:200]:
        a, op, b = row.prompt.removeprefix("What is ").removesuffix("?").split()
        assert int(row.reference) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert max(len(r.prompt.split()[2]) for r in train) == 2  # multi-digit operands
    qa = task_examples("stdlib_qa", "train")
    assert len(qa) > 100 and all(r.prompt.startswith("What does ") for r in qa)
    assert not {r.prompt for r in qa} & {r.prompt for r in task_examples("stdlib_qa", "test")}
    for pair in arithmetic_preferences("test", 50):
        assert extract_number(pair.chosen) != extract_number(pair.rejected)
    with pytest.raises(ConfigError, match="unknown task 'poetry'"):
        task_examples("poetry", "train")


def test_three_digit_task_and_mixtures():
    train, test = task_examples("arithmetic3", "train"), task_examples("arithmetic3", "test")
    assert len(train) + len(test) == 60_000 and 0.08 < len(test) / 60_000 < 0.12
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    operands = [r.prompt.removeprefix("What is ").removesuffix("?").split() for r in test]
    assert all(int(r.reference) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
               for r, (a, op, b) in zip(test, operands, strict=True))
    # digit counts drawn before values: every alignment is common, 3-by-3 no longer 81 %
    shapes = Counter((len(a), len(b)) for a, _, b in operands)
    assert len(shapes) == 9  # (1, 1) has only 155 problems in all, (1, 2) and (2, 1) ~900
    assert all(shapes[shape] > 0.05 * len(test) for shape in shapes if 3 in shape or
               shape == (2, 2))
    assert 0.15 < shapes[(3, 3)] / len(test) < 0.25
    assert {op for _, op, _ in operands} == {"+", "-"}
    hardest = task_examples("arithmetic3x3", "test")
    assert {r.prompt for r in hardest} == {r.prompt for r, (a, _, b) in
                                           zip(test, operands, strict=True)
                                           if len(a) == len(b) == 3}
    assert not {r.prompt for r in hardest} & {r.prompt for r in
                                              task_examples("arithmetic3x3", "train")}
    mixed = task_examples("arithmetic+arithmetic3", "test")
    assert sorted(mixed, key=str) == sorted(task_examples("arithmetic", "test") + test, key=str)
    assert mixed == task_examples("arithmetic+arithmetic3", "test")  # one seeded order
    digits = [len(r.prompt.split()[2]) for r in mixed[:200]]
    assert 2 in digits and 3 in digits  # interleaved, not one task after the other
    assert task_examples("arithmetic+arithmetic3", "test", 10) == mixed[:10]
    # a tool mixture answers its rows through the calculator after the cut: the same rows
    tools = task_examples("arithmetic3_tool+arithmetic3x3_tool", "test", 300)
    answered = {r.prompt: r for r in task_examples("arithmetic3_tool", "test")}
    assert len(tools) == 300 and all(r == answered[r.prompt] for r in tools)
    assert [r.prompt for r in tools] == [r.prompt for r in task_examples(
        "arithmetic3+arithmetic3x3", "test", 300)]  # the plain mixture's seeded order
    with pytest.raises(ConfigError, match="unknown task 'poetry' in 'arithmetic\\+poetry'"):
        task_examples("arithmetic+poetry", "train")


def test_three_digit_preference_pairs_prefer_the_verified_answer():
    pairs = load_preference_dataset("task:arithmetic3", "test", 300)
    assert len(pairs) == 300
    prompts = {r.prompt for r in task_examples("arithmetic3", "test")}
    misses = set()
    for row in pairs:
        assert row.prompt[0]["content"] in prompts
        chosen, rejected = (extract_number(side[0]["content"]) for side in (row.chosen,
                                                                            row.rejected))
        assert chosen != rejected
        misses.add(abs(chosen - rejected))
    assert {1, 10, 100} <= misses  # near misses of every place value, carry errors included
    with pytest.raises(ConfigError, match="no preference pairs for task 'poetry'"):
        load_preference_dataset("task:poetry")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([prose(i, paragraphs=2) for i in range(40)], vocab_size=400,
                           show_progress=False)


def test_lathe_template_masks_exactly_the_assistant_contents_and_end_tokens(tokenizer):
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "42"},
                {"role": "user", "content": "And the river?"},
                {"role": "assistant", "content": "It flows quietly past the old mill."}]
    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": END_OF_TURN})
    ids, mask = ChatEncoder(tokenizer, template, "lathe's").conversation(Chat(messages))
    assert len(ids) == len(mask)
    decoded = trained_text(tokenizer, ids, mask)
    assert decoded == ["42" + END_OF_TURN, "It flows quietly past the old mill." + END_OF_TURN]


def test_dataset_records_are_validated_by_line_and_field(tmp_path):
    good = tmp_path / "chat.jsonl"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    assert load_chat_dataset(str(good))[0].messages[1]["content"] == "hello"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl line 1: messages has no assistant turn"):
        load_chat_dataset(str(bad))
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps({"prompt": "2+2?", "chosen": [{"role": "assistant",
                                                               "content": "4"}],
                                 "rejected": "5"}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match="prefs.jsonl line 3: missing field 'chosen'"):
        load_preference_dataset(str(prefs))
    row = load_preference_dataset(str(prefs), limit=1)[0]
    assert row.chosen == [{"role": "assistant", "content": "4"}]
    assert row.rejected == [{"role": "assistant", "content": "5"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "2+2?", "reference": 4}) + "\n")
    with pytest.raises(ConfigError, match="line 1: field 'reference'"):
        load_prompt_dataset(str(prompts))
    assert load_prompt_dataset("task:arithmetic", "test", limit=3)[0].prompt[0]["role"] == "user"


CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.mark.parametrize(("record", "named"), [
    ([1, 2], "line 1: a record must be a JSON object, not list"),
    ({"messages": "hi"}, "line 1: messages must be a list of messages, not a string"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages\\[0\\].role is 'bot'"),
    ({"messages": [{"role": "user"}]}, "messages\\[0\\].content is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
     "messages\\[0\\].tool_calls is not a field of a user message"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]},
     "messages\\[0\\].tool_calls must be a non-empty list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                      "arguments": "{x"}}]}]},
     "tool_calls\\[0\\].function.arguments is not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                      "arguments": "[1]"}}]}]},
     "tool_calls\\[0\\].function.arguments must be a JSON object, got list"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
     "tool_calls\\[0\\].function.name must be a non-empty string"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]},
     "messages\\[0\\].reasoning_content must be a string"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url"}]}]},
     "parts of type 'image_url' are not supported"),
    ({"messages": [{"role": "assistant", "content": "x"}], "tools": {"name": "f"}},
     "tools must be a list of tools"),
    ({"messages": [{"role": "assistant", "content": "x"}], "tools": [{"function": {}}]},
     "tools\\[0\\].function.name must be a non-empty string"),
])
def test_each_malformed_chat_record_is_one_error_naming_line_and_field(tmp_path, record,
                                                                       named):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=named):
        load_chat_dataset(str(path))


def test_tool_calls_and_reasoning_load_in_the_form_templates_read(tmp_path):
    record = {"tools": [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}],
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text",
                                                                         "text": "3?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "c1"}],
             "reasoning": "I should add."},
            {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"},
            {"role": "assistant", "content": "5"}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    chat = load_chat_dataset(str(path))[0]
    assert chat.tools == record["tools"] and chat.where == f"{path} line 1"
    assert chat.messages[1] == {"role": "user", "content": "2+3?"}
    assert chat.messages[2] == {"role": "assistant", "reasoning": "I should add.", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 2,
                                                                                   "b": 3}}}]}
    assert chat.messages[3]["tool_call_id"] == "c1"


def test_hf_datasets_with_a_messages_column_load(tmp_path):
    folder = tmp_path / "hfchat"
    folder.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats = load_chat_dataset(f"hf:{folder}:train")  # datasets' loader on a local folder
    assert [c.messages[1]["content"] for c in chats] == ["a0", "a1", "a2"]


def test_unpaired_rows_load_and_pairs_unpair(tmp_path):
    """KTO's rows as TRL's unpaired format gives them; a pair is two rows, its chosen reply
    desirable, as `unpair_preference_dataset` makes them; a bad label names the line."""
    file = tmp_path / "kto.jsonl"
    file.write_text(json.dumps({"prompt": "2+2?", "completion": "4", "label": True}) + "\n"
                    + json.dumps({"prompt": "3+3?", "chosen": "6", "rejected": "7"}) + "\n")
    rows = load_unpaired_dataset(str(file))
    assert [(r.prompt[0]["content"], r.completion[0]["content"], r.label) for r in rows] == [
        ("2+2?", "4", True), ("3+3?", "6", True), ("3+3?", "7", False)]
    assert len(load_unpaired_dataset(str(file), limit=2)) == 2
    tasks = load_unpaired_dataset("task:arithmetic", "train", 6)
    assert [r.label for r in tasks] == [True, False] * 3
    file.write_text(json.dumps({"prompt": "2+2?", "completion": "4", "label": "yes"}) + "\n")
    with pytest.raises(ConfigError, match="line 1: field 'label' must be true or false"):
        load_unpaired_dataset(str(file))
    file.write_text(json.dumps({"prompt": "2+2?", "label": True}) + "\n")
    with pytest.raises(ConfigError, match="missing field 'completion'"):
        load_unpaired_dataset(str(file))
