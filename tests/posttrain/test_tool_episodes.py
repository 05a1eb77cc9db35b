"""Multi-turn episodes with tools on the serve engine: a scripted model (logits fixed by
position) gives the exact expected transcript and token split; tool results carry no loss
in GRPO's batch; hostile tools and endless calling end cleanly; turns reuse the prefix
cache."""

from __future__ import annotations

import torch

from lathe.data.chat_encoding import chat_encoder
from lathe.data.tools import load_tool
from lathe.model import ModelConfig, Transformer
from lathe.model.checkpoint import read_eos_ids
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.config import ToolsConfig
from lathe.posttrain.rollouts import Rollout, collate
from lathe.posttrain.tool_episodes import EpisodePrompt, EpisodeRunner
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams

COUNTER = "tests.data.tools_for_tests:counter"
HANGS = "tests.data.tools_for_tests:hangs"


class Scripted(Transformer):
    """A real model whose logits are replaced by a script: after the token at position p
    comes `script[p]`, else the end of turn. Every row of a batch reads the same script."""

    def __init__(self, config: ModelConfig, end_of_turn: int) -> None:
        super().__init__(config)
        self.script: dict[int, int] = {}
        self.end_of_turn = end_of_turn

    def write(self, start: int, ids: list[int]) -> None:
        """Script `ids` to follow position `start`."""
        for offset, token in enumerate(ids):
            self.script[start + offset] = token

    def forward(self, input_ids, labels=None, positions=None, kv_cache=None,
                logits_to_keep=None, **kwargs):
        out = super().forward(input_ids, labels, positions, kv_cache, logits_to_keep, **kwargs)
        where = kv_cache.prepare(input_ids, positions)[0]
        kept = where[logits_to_keep] if logits_to_keep is not None else where
        logits = torch.full_like(out.logits, -1e4)
        for row, position in enumerate(kept.tolist()):
            logits[0, row, self.script.get(position, self.end_of_turn)] = 0.0
        return out._replace(logits=logits)


def setup(base, names, max_tool_turns=2, template=None):
    encoder = chat_encoder(base, template)
    vocab = encoder.tokenizer.get_vocab_size(with_added_tokens=True)
    eos = read_eos_ids(base, vocab)
    torch.manual_seed(0)
    model = Scripted(ModelConfig.from_preset("tiny", vocab_size=vocab, n_layers=1,
                                              max_seq_len=512), eos[0]).eval()
    engine = LLMEngine(model, encoder.tokenizer, EngineConfig(num_blocks=128), eos)
    runner = EpisodeRunner(encoder, ToolsConfig(names=names, seconds=1.0,
                                                max_tool_turns=max_tool_turns))
    return encoder, model, engine, runner, eos[0]


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_scripted_episode_is_the_expected_transcript(base):
    encoder, model, engine, runner, eot = setup(base, [COUNTER])
    tools = [load_tool(COUNTER).definition]
    question = [{"role": "user", "content": "Count on from 41."}]
    prompt = encoder.prompt(question, tools)
    turn1 = encoder.encode(call_text("counter", '{"start": 41}')) + [eot]
    call = {"type": "function", "id": "call_1_0",
            "function": {"name": "counter", "arguments": {"start": 41}}}
    conversation = question + [{"role": "assistant", "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_1_0", "name": "counter",
                                "content": "42"}]
    before_answer = encoder.prompt(conversation, tools)  # through the next generation prompt
    tool_tokens = before_answer[len(prompt) + len(turn1):]
    assert before_answer[:len(prompt) + len(turn1)] == prompt + turn1
    turn2 = encoder.encode("It is 42.") + [eot]
    model.write(len(prompt) - 1, turn1)
    model.write(len(before_answer) - 1, turn2)

    params = SamplingParams(max_tokens=200, temperature=0, logprobs=0)
    [[episode]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)], [params])
    assert episode.completion_ids == turn1 + tool_tokens + turn2
    assert episode.policy == [True] * len(turn1) + [False] * len(tool_tokens) + [True] * len(
        turn2)
    full = conversation + [{"role": "assistant", "content": "It is 42."}]
    assert episode.messages == full
    # the whole episode is the template's rendering of the conversation, token for token
    assert prompt + episode.completion_ids == encoder.encode(
        encoder.render(full, tools, add_generation_prompt=False))
    assert (episode.answer, episode.turns, episode.tool_calls, episode.tool_errors,
            episode.finish_reason) == ("It is 42.", 2, 1, 0, "stop")
    assert episode.transcript() == '[counter({"start": 41})] [-> 42] It is 42.'
    assert len(episode.logprobs) == len(episode.completion_ids)
    assert engine.stats()["prefix_cache_hits"] > 0  # turn 2 reused turn 1's blocks

    # in GRPO's batch the tool's tokens carry no loss; the model's do
    rollout = Rollout(prompt, episode.completion_ids, 1.0, 1.0, episode.logprobs,
                      episode.policy)
    labels = collate([rollout], 0, torch.device("cpu"))["labels"][0].tolist()
    start = len(prompt)
    assert labels[:start] == [IGNORE_INDEX] * start
    assert labels[start:] == turn1 + [IGNORE_INDEX] * len(tool_tokens) + turn2
    runner.close()


def test_endless_calls_and_hostile_tools_end_the_episode_cleanly(base):
    encoder, model, engine, runner, eot = setup(base, [COUNTER, HANGS], max_tool_turns=2)
    tools = [load_tool(HANGS).definition]  # offered; the runner also has the counter
    question = [{"role": "user", "content": "Go."}]
    prompt = encoder.prompt(question, tools)
    # the model calls `hangs` at every turn: each result is an error, and the third turn
    # (past max_tool_turns) ends the episode without running its call
    turn = encoder.encode(call_text("hangs", "{}")) + [eot]
    model.write(len(prompt) - 1, turn)
    messages = question + [{"role": "assistant", "tool_calls": [{
        "type": "function", "id": "call_1_0", "function": {"name": "hangs", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "hangs",
         "content": "error: hangs did not finish within 1 s; it was stopped"}]
    second = len(encoder.prompt(messages, tools))
    model.write(second - 1, turn)
    messages[1:] += [{"role": "assistant", "tool_calls": [{
        "type": "function", "id": "call_2_0", "function": {"name": "hangs", "arguments": {}}}]},
        {**messages[2], "tool_call_id": "call_2_0"}]
    model.write(len(encoder.prompt(messages, tools)) - 1, turn)
    [[episode]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)],
                             [SamplingParams(max_tokens=300, temperature=0)])
    assert (episode.turns, episode.tool_calls, episode.tool_errors, episode.finish_reason) == (
        3, 3, 2, "tool_turns")
    assert episode.answer == ""
    assert sum(episode.policy) == 3 * len(turn)
    # a budget too small for the tool's result ends the episode after the first turn
    model.script.clear()
    tools = [load_tool(COUNTER).definition]
    prompt = encoder.prompt(question, tools)
    counting = encoder.encode(call_text("counter", '{"start": 1}')) + [eot]
    model.write(len(prompt) - 1, counting)
    [[short]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)],
                           [SamplingParams(max_tokens=len(counting) + 3, temperature=0)])
    assert (short.turns, short.tool_calls, short.finish_reason) == (1, 1, "length")
    assert short.completion_ids == counting and short.messages[-1]["role"] == "tool"
    runner.close()


def test_without_tools_an_episode_is_the_engines_completion(base):
    encoder, model, engine, runner, eot = setup(base, [])
    prompt = encoder.prompt([{"role": "user", "content": "Hi"}])
    params = [SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5, logprobs=0)]
    model.script.clear()
    for p in range(len(prompt) - 1, len(prompt) + 8):
        model.script[p] = 100 + p % 7
    [group] = runner.run(engine, [EpisodePrompt(prompt, [{"role": "user", "content": "Hi"}])],
                         params)
    [direct] = engine.generate([prompt], params)
    assert [e.completion_ids for e in group] == [o.token_ids for o in direct.outputs]
    assert [e.answer for e in group] == [o.text for o in direct.outputs]
    assert all(all(e.policy) and e.turns == 1 for e in group)


def test_a_reward_that_takes_messages_sees_the_whole_episode():
    from lathe.posttrain.rewards import exact_number
    from lathe.posttrain.rollouts import episode_reward
    from lathe.posttrain.tool_episodes import Episode

    seen = []

    def used_a_tool(completion: str, reference: str, messages: list) -> float:
        seen.append(messages)
        return float(any(m["role"] == "tool" for m in messages))

    episode = Episode([1], [{"role": "user", "content": "What is 2 + 3?"}])
    episode.messages += [{"role": "assistant", "tool_calls": []},
                         {"role": "tool", "content": "5"},
                         {"role": "assistant", "content": "5"}]
    episode.answer = "5"
    assert episode_reward([(exact_number, 1.0), (used_a_tool, 0.5)], episode, "5") == 1.5
    assert seen == [episode.messages]


def test_a_foreign_template_writing_after_its_end_of_turn_token(tmp_path):
    """ChatML (Qwen2.5's shape) closes a turn with `<|im_end|>` and then a newline the model
    never samples: the episode continues after the model's `<|im_end|>`, and its text is the
    template's rendering of the whole conversation (less that last newline)."""
    from lathe.data.chat_encoding import ChatEncoder
    from lathe.data.chat_template import ChatTemplate
    from lathe.data.tokenizer import train_tokenizer
    from tests.data.chat_templates import CHATML, SPECIAL_TOKENS, plain
    from tests.data.corpus import prose

    tokenizer = train_tokenizer([prose(i, paragraphs=2) for i in range(40)], vocab_size=500,
                                show_progress=False)
    calls = ["<tool_call>", "</tool_call>"]  # added but not special in Qwen's tokenizer: decoded
    tokenizer.add_special_tokens([t for t in SPECIAL_TOKENS if t not in calls])
    tokenizer.add_tokens(calls)
    encoder = ChatEncoder(tokenizer, ChatTemplate(plain(CHATML), {"eos_token": "<|im_end|>"}),
                          "the chatml template")
    eot = tokenizer.token_to_id("<|im_end|>")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    torch.manual_seed(0)
    model = Scripted(ModelConfig.from_preset("tiny", vocab_size=vocab, n_layers=1,
                                              max_seq_len=1024), eot).eval()
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=256), [eot])
    runner = EpisodeRunner(encoder, ToolsConfig(names=[COUNTER]))
    tools = runner.definitions()
    question = [{"role": "user", "content": "Count on from 41."}]
    prompt = encoder.prompt(question, tools)
    model.write(len(prompt) - 1, encoder.encode("\n" + call_text("counter", '{"start": 41}'))
                + [eot])
    [[first]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)],
                           [SamplingParams(max_tokens=300, temperature=0)])
    # its answer was the end-of-turn token alone; the real one starts where that one did
    answer_at = len(prompt) + len(first.completion_ids) - 2
    model.write(answer_at, encoder.encode("It is 42.") + [eot])
    [[episode]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)],
                             [SamplingParams(max_tokens=300, temperature=0)])
    runner.close()
    assert (episode.turns, episode.tool_calls, episode.finish_reason, episode.answer) == (
        2, 1, "stop", "It is 42.")
    assert episode.messages[2]["content"] == "42"
    rendered = encoder.render(episode.messages, tools, add_generation_prompt=False)
    assert tokenizer.decode(prompt + episode.completion_ids, skip_special_tokens=False) == \
        rendered.removesuffix("\n")
    tool_text = tokenizer.decode([t for t, mine in zip(episode.completion_ids, episode.policy,
                                                       strict=True) if not mine],
                                 skip_special_tokens=False)
    assert tool_text == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" \
        "\n<|im_start|>assistant\n"


def test_the_parser_is_the_chat_templates_format_unless_named(base):
    """tools.parser left empty reads calls as the chat template writes them; a template
    that writes none is refused by name before a tool process starts."""
    import pytest

    from lathe.core.errors import ConfigError
    from lathe.data.chat_encoding import ChatEncoder
    from lathe.data.chat_template import ChatTemplate
    from tests.data.chat_templates import GEMMA, QWEN3_CODER, plain

    tokenizer = chat_encoder(base).tokenizer

    def runner(template: str, parser: str = "") -> EpisodeRunner:
        encoder = ChatEncoder(tokenizer, ChatTemplate(plain(template), {}), "the template")
        return EpisodeRunner(encoder, ToolsConfig(names=[COUNTER], parser=parser))

    for template, parser, expected in ((QWEN3_CODER, "", "qwen3_coder"),
                                       (QWEN3_CODER, "hermes", "hermes")):
        episodes = runner(template, parser)
        assert episodes.parser.name == expected
        episodes.close()
    with pytest.raises(ConfigError, match="tools.parser"):
        runner(GEMMA)


JSON_CALL = ("{{ '<tool_call>\\n{\\\"name\\\": ' + call['name'] | tojson + "
             "', \\\"arguments\\\": ' }}"
             "{{ call['arguments'] if call['arguments'] is string "
             "else call['arguments'] | tojson }}"
             "{{ '}\\n</tool_call>' }}")
XML_CALL = ("{{ '<tool_call>\\n<function=' + call['name'] + '>\\n' }}"
            "{% for key, value in call['arguments'].items() %}"
            "{{ '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) "
            "+ '\\n</parameter>\\n' }}{% endfor %}"
            "{{ '</function>\\n</tool_call>' }}")


def test_an_episode_reads_calls_in_its_templates_markup(base, tmp_path):
    """lathe's template with calls written as Qwen3-Coder's markup: with tools.parser left
    empty the episode reads the model's call in it, its parameter typed by the tool's
    schema (41, the integer the counter takes, not "41"), and the episode is the
    template's rendering token for token."""
    from lathe.data.chat import CHAT_TEMPLATE

    assert JSON_CALL in CHAT_TEMPLATE
    template = tmp_path / "markup.jinja"
    template.write_text(CHAT_TEMPLATE.replace(JSON_CALL, XML_CALL))
    encoder, model, engine, runner, eot = setup(base, [COUNTER], template=template)
    assert runner.parser.name == "qwen3_coder"
    tools = [load_tool(COUNTER).definition]
    question = [{"role": "user", "content": "Count on from 41."}]
    prompt = encoder.prompt(question, tools)
    turn1 = encoder.encode("<tool_call>\n<function=counter>\n<parameter=start>\n41\n"
                           "</parameter>\n</function>\n</tool_call>") + [eot]
    call = {"type": "function", "id": "call_1_0",
            "function": {"name": "counter", "arguments": {"start": 41}}}
    conversation = question + [{"role": "assistant", "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call_1_0", "name": "counter",
                                "content": "42"}]
    before_answer = encoder.prompt(conversation, tools)
    turn2 = encoder.encode("It is 42.") + [eot]
    model.write(len(prompt) - 1, turn1)
    model.write(len(before_answer) - 1, turn2)
    [[episode]] = runner.run(engine, [EpisodePrompt(prompt, question, tools)],
                             [SamplingParams(max_tokens=200, temperature=0)])
    full = conversation + [{"role": "assistant", "content": "It is 42."}]
    assert episode.messages == full
    assert prompt + episode.completion_ids == encoder.encode(
        encoder.render(full, tools, add_generation_prompt=False))
    assert (episode.answer, episode.tool_calls, episode.tool_errors) == ("It is 42.", 1, 0)
    runner.close()
