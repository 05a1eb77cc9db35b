"""What a user serving a Qwen-, Llama- or Mistral-shaped checkpoint sends, through the
official client: a tokenizer whose call and reasoning markers are added tokens as the
real ones are (`<tool_call>`, `<think>` added but not special; `[TOOL_CALLS]`,
`<|python_tag|>`, `<|im_end|>` special). Forced calls on every parser, streamed and not,
whose arguments validate; a truncated parallel call keeps its complete calls; reasoning
split from the answer and a call read after it; and vLLM's current request fields, each
against its vLLM meaning."""

from __future__ import annotations

import contextlib
import json
import random
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from tokenizers import AddedToken, Tokenizer

from lathe.model import load_checkpoint, save_checkpoint
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.reasoning import ReasoningStream, reasoning_parser, template_reasoning_parser
from lathe.serve.structured import GrammarCompiler, Literals
from lathe.serve.tool_calls import tool_call_parser
from tests.builders import serve_model
from tests.data.chat_templates import CHATML, GLM4, MISTRAL_ARGS, QWEN3, QWEN3_CODER, plain
from tests.serve.conftest import served

ADD = {"type": "object", "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
         {"type": "function", "function": {"name": "shout", "parameters": {
             "type": "object", "required": ["word"], "additionalProperties": False,
             "properties": {"word": {"enum": ["hi", "ho"]}}}}}]
SCHEMAS = {"add": {**ADD, "additionalProperties": False},
           "shout": TOOLS[1]["function"]["parameters"]}
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "<|python_tag|>"]

# Mistral's tool template trait: a call id that is not 9 letters and digits is refused
MISTRAL_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS]' }}"
    "{{- message.tool_calls | map(attribute='function') | list | tojson }}{{- eos_token }}"
    "{%- for call in message.tool_calls %}"
    "{%- if not (call.id is string and call.id | length == 9 and call.id.isalnum()) %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- message.content + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
)
# Hermes-3's tool_use trait: the template fails without tools
TOOLS_ONLY = ("{%- if not tools %}{{- raise_exception('this template needs tools') }}"
              "{%- endif %}" + plain(CHATML))
# DeepSeek-R1's trait: the generation prompt opens the reasoning
R1 = plain(CHATML).replace("'<|im_start|>assistant\\n' }}{%- endif %}",
                           "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen_checkpoint(checkpoint, tmp_path_factory):
    """The serve checkpoint's BPE with Qwen's shape of added tokens, on a model with room
    for tool schemas."""
    root = tmp_path_factory.mktemp("qwen")
    folder = root / "tokenizer"
    folder.mkdir()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config.update(eos_token="<|im_end|>", chat_template=plain(CHATML))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return save_checkpoint(serve_model(vocab, max_seq_len=1024), root / "ckpt",
                           tokenizer=folder)


def load(path, **config):
    return lambda: LLMEngine.from_checkpoint(path, EngineConfig(num_blocks=256, **config))


@contextlib.contextmanager
def client_with(checkpoint, name: str, template: str, **config):
    """The official client of a server on `checkpoint` rendering `template` (written to
    `name` beside it), `config` its other `ServerConfig` fields."""
    path = checkpoint.parent / name
    path.write_text(template)
    with served(checkpoint, load=load(checkpoint), chat_template=path, **config) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hermes(qwen_checkpoint):
    with served(qwen_checkpoint, load=load(qwen_checkpoint), tool_call_parser="hermes",
                max_tool_calls=4, trust_request_chat_template=True) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def calls_of(choice) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def streamed(client, **request) -> tuple[str, str, list, str, list]:
    """A streamed chat's (content, reasoning, calls, finish reason, every chunk)."""
    content, reasoning, calls, finish, chunks = "", "", [], None, []
    for chunk in client.chat.completions.create(stream=True, **request):
        chunks.append(chunk)
        if not chunk.choices:  # the usage chunk
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        calls += [(c.function.name, json.loads(c.function.arguments))
                  for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, calls, finish, chunks


FORCED = {  # format: (its parser, a template that writes it, --tool-call-parser)
    "hermes": ("hermes", lambda: plain(CHATML), None),
    "llama3_json": ("llama3_json", lambda: plain(CHATML), "llama3_json"),
    "mistral": ("mistral", lambda: MISTRAL_TOOLS, None),
    "mistral_args": ("mistral", lambda: plain(MISTRAL_ARGS), None),
    "qwen3_coder": ("qwen3_coder", lambda: plain(QWEN3_CODER), None),
    "glm45": ("glm45", lambda: plain(GLM4), "glm45"),
}


@pytest.mark.parametrize("form", sorted(FORCED))
def test_forced_calls_on_added_token_markers_work_for_every_parser(qwen_checkpoint, form):
    """20 seeds, required (one call, then parallel) and named, streamed and not: every
    reply is calls whose arguments validate (strict `add` takes no extra keys). The parser
    is the template's format unless named (a template writing <tool_call> serves a
    llama3_json model here). The calls start at the reply's first token (no reasoning
    parser: GLM's think blocks are the reasoning tests')."""
    family, template, named = FORCED[form]
    with client_with(qwen_checkpoint, f"{form}.jinja", template(), tool_call_parser=named,
                     max_tool_calls=3, reasoning_parser="none") as client:
        for seed in range(20):
            request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                           temperature=1.0, seed=seed, parallel_tool_calls=seed % 2 == 1,
                           tool_choice="required" if seed % 4 < 2 else
                           {"type": "function", "function": {"name": "add"}})
            choice = client.chat.completions.create(**request).choices[0]
            calls = calls_of(choice)
            named = seed % 4 >= 2
            if choice.finish_reason == "length":  # a parallel reply cut while calling
                assert seed % 4 == 1 and calls, choice.message
            else:
                assert choice.finish_reason == ("stop" if named else "tool_calls")
                assert 1 <= len(calls) <= (3 if seed % 4 == 1 else 1), choice.message
            assert not choice.message.content, choice.message
            if named:
                assert {name for name, _ in calls} == {"add"}
            for call in choice.message.tool_calls:
                assert re.fullmatch(r"[A-Za-z0-9]{9}" if family == "mistral"
                                    else r"call_[0-9a-f]{24}", call.id)
            if seed < 4:
                content, _, stream_calls, finish, _ = streamed(client, **request)
                assert (stream_calls, finish) == (calls, choice.finish_reason)
                assert not content
        # the calls are written the way the served template writes them
        ids = client.chat.completions.create(**request, extra_body={
            "return_token_ids": True}).choices[0].model_extra["token_ids"]
        written = Tokenizer.from_file(str(qwen_checkpoint / "tokenizer.json")).decode(
            ids, skip_special_tokens=False)
        assert {"mistral_args": "[ARGS]", "qwen3_coder": "<parameter=a>",
                "glm45": "<arg_key>a</arg_key>"}.get(form, "") in written, written


def test_parallel_tool_calls_false_returns_a_replys_first_call_alone(hermes, qwen_checkpoint):
    """tool_choice auto: a reply that makes two calls (made to by a grammar here) returns
    the first alone when parallel_tool_calls is false, streamed or not, as vLLM's does."""
    tokenizer = Tokenizer.from_file(str(qwen_checkpoint / "tokenizer.json"))
    grammar = tool_call_parser("hermes").grammar(TOOLS, 2, Literals.of(tokenizer)).grammar
    for seed in range(10):
        request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                       temperature=1.0, seed=seed,
                       extra_body={"structured_outputs": {"grammar": grammar}})
        both = calls_of(hermes.chat.completions.create(**request).choices[0])
        if len(both) == 2:
            break
    assert len(both) == 2
    alone = hermes.chat.completions.create(**request, parallel_tool_calls=False).choices[0]
    assert calls_of(alone) == both[:1] and alone.finish_reason == "tool_calls"
    _, _, streamed_calls, finish, _ = streamed(hermes, **request, parallel_tool_calls=False)
    assert (streamed_calls, finish) == (both[:1], "tool_calls")


def test_a_truncated_parallel_reply_returns_its_complete_calls(hermes):
    cut = 0
    for seed in range(12):
        choice = hermes.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=60, temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason != "length":
            continue
        cut += 1
        calls = calls_of(choice)  # the complete ones, arguments valid
        assert calls and choice.message.content is None, choice.message
    assert cut >= 2  # the model keeps calling until max_tokens cuts one


def test_the_mistral_template_takes_the_call_ids_back(qwen_checkpoint):
    with client_with(qwen_checkpoint, "mistral-roundtrip.jinja", MISTRAL_TOOLS,
                     tool_call_parser="mistral") as client:
        first = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, seed=0).choices[0].message
        (call,) = first.tool_calls
        follow = [*MESSAGES, first.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        reply = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS,
                                               max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_template_that_needs_tools_keeps_chat_on(qwen_checkpoint):
    with client_with(qwen_checkpoint, "tools-only.jinja", TOOLS_ONLY,
                     tool_call_parser="hermes") as client:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                               tool_choice="required", max_tokens=60, seed=0)
        assert reply.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError, match="needs tools"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)


def test_strict_tools_admit_no_extra_keys(qwen_checkpoint):
    engine = LLMEngine.from_checkpoint(qwen_checkpoint)
    literals = Literals.of(engine.tokenizer)
    constraints = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size,
                                  engine.eos_token_ids)
    parser = tool_call_parser("hermes")
    for strict, admitted in ((True, False), (False, True)):
        tools = [{"type": "function", "function": {"name": "add", "parameters": ADD,
                                                   "strict": strict}}]
        matcher = constraints.compile(parser.grammar(tools, 1, literals))
        text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}\n'
                '</tool_call>')
        ids = engine.encode(text)
        assert (matcher.validate_tokens(ids) == len(ids)) is admitted


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_reasoning_streams_add_up_to_the_whole_split(chunk):
    parser = reasoning_parser("qwen3")
    cases = [("<think>\nplan</think>\n\nanswer", False, ("\nplan", "\n\nanswer")),
             ("plan a</think>answer", True, ("plan a", "answer")),
             ("  <think>cut off before its end", False, ("cut off before its end", "")),
             ("just an answer <think> in text", False, (None, "just an answer <think> in text")),
             ("<thin", False, (None, "<thin")),
             ("", True, ("", ""))]
    for text, inside, expected in cases:
        assert parser.split(text, inside) == expected, text
        stream = ReasoningStream(parser, inside)
        pieces = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
        pieces.append(stream.finish())
        reasoning = "".join(r for r, _ in pieces)
        content = "".join(c for _, c in pieces)
        assert (reasoning if stream.reasoned else None, content) == expected, text
    assert parser.starts_inside("<|im_start|>assistant\n<think>\n")
    assert not parser.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning_parser("deepseek_r1").starts_inside("no tag at all")
    magistral = reasoning_parser("mistral")
    assert magistral.split("[THINK]plan[/THINK]answer", False) == ("plan", "answer")
    assert magistral.split("<think>x</think>y", False) == (None, "<think>x</think>y")
    stream = ReasoningStream(magistral, False)
    pieces = [stream.feed(ch) for ch in "[THINK]a[/THIN"] + [stream.feed("K]b"), stream.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("a", "b")
    # a template's markers imply its parser: Magistral's system prompt shows both
    assert template_reasoning_parser("[SYSTEM_PROMPT]Think: [THINK]draft[/THINK]answer"
                                     "[/SYSTEM_PROMPT]").name == "mistral"
    assert template_reasoning_parser("{{ '<think>' }}").name == "qwen3"
    assert template_reasoning_parser("[INST]{{ m }}[/INST]") is None
    assert not magistral.starts_inside("[THINK]draft[/THINK]answer[INST]hi[/INST]")
    # Gemma 4 thinks in its thought channel; a prompt with thinking off closes an empty one
    gemma = reasoning_parser("gemma4")
    assert gemma.split("<|channel>thought\nplan<channel|>answer", False) == ("plan", "answer")
    assert not gemma.starts_inside("<|turn>model\n<|channel>thought\n<channel|>")
    assert gemma.starts_inside("<|turn>model\n<|channel>thought\n")
    from trl import __file__ as trl_init
    for name in ("gemma4", "gemma4_v5"):
        source = (Path(trl_init).parent / "chat_templates" / f"{name}.jinja").read_text()
        assert template_reasoning_parser(source).name == "gemma4"


def test_reasoning_is_split_and_a_call_after_it_is_read(qwen_checkpoint):
    """DeepSeek-R1's prompt opens the reasoning; a call forced by tool_choice comes after
    it (the grammar holds for the answer, as vLLM's structured outputs do: constrained from
    the first token, the call was written inside the reasoning and no call came back).
    Streamed deltas add up to the unstreamed message; usage counts the reasoning tokens
    through </think>."""
    template = qwen_checkpoint.parent / "r1.jinja"
    template.write_text(R1)
    tokenizer = Tokenizer.from_file(str(qwen_checkpoint / "tokenizer.json"))
    end = tokenizer.token_to_id("</think>")
    with served(qwen_checkpoint, load=load(qwen_checkpoint), tool_call_parser="hermes",
                chat_template=template) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for seed in range(3):
            # a random model closes its reasoning within a few tokens
            request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                           seed=seed, temperature=1.0, tool_choice="required",
                           parallel_tool_calls=False, logit_bias={str(end): 5},
                           extra_body={"return_token_ids": True})
            whole = client.chat.completions.create(**request)
            message = whole.choices[0].message
            reasoning = message.model_extra["reasoning_content"]
            assert isinstance(reasoning, str), message
            assert len(calls_of(whole.choices[0])) == 1, message
            assert whole.choices[0].finish_reason == "tool_calls" and not message.content.strip()
            ids = whole.choices[0].model_extra["token_ids"]
            assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(end) + 1
            content, streamed_reasoning, calls, finish, chunks = streamed(
                client, **request, stream_options={"include_usage": True})
            assert (streamed_reasoning, content, finish) == (reasoning, message.content,
                                                             "tool_calls")
            assert calls == calls_of(whole.choices[0])
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == \
                whole.usage.completion_tokens_details.reasoning_tokens
            hidden = client.chat.completions.create(
                **{**request, "extra_body": {**request["extra_body"],
                                             "include_reasoning": False}})
            assert "reasoning_content" not in hidden.choices[0].message.model_extra or \
                hidden.choices[0].message.model_extra["reasoning_content"] is None
        # `lathe chat URL` shows the reasoning as it streams and keeps the answer alone
        from lathe.serve.chat import RemoteChat, say
        written: list[str] = []
        sampling = {"max_tokens": 40, "seed": 0, "temperature": 1.0,
                    "logit_bias": {str(end): 5}, "ignore_eos": True}
        added = say(RemoteChat(url, model="tiny"), MESSAGES, sampling, written.append)
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, **{
            k: v for k, v in sampling.items() if k != "ignore_eos"},
            extra_body={"ignore_eos": True}).choices[0].message
        shown = "".join(written)
        assert shown.startswith("[thinking] " + answer.model_extra["reasoning_content"] + "\n")
        assert added == [{"role": "assistant", "content": answer.content}] and answer.content
        assert shown.endswith(answer.content)
    # `lathe chat CHECKPOINT` splits the reasoning off as the server does
    from lathe.serve.chat import LocalChat
    written = []
    local = say(LocalChat(qwen_checkpoint, chat_template=template), MESSAGES,
                {**sampling, "logit_bias": {end: 5}}, written.append)
    assert "".join(written) == shown and local == added


def test_qwen3_templates_imply_the_reasoning_parser(qwen_checkpoint):
    """A Qwen3 template turns the reasoning parser on: the reply's think block is its
    reasoning_content (in the Responses API a reasoning item), and enable_thinking=false
    renders the empty block."""
    template = qwen_checkpoint.parent / "qwen3.jinja"
    template.write_text(plain(QWEN3))
    tokenizer = Tokenizer.from_file(str(qwen_checkpoint / "tokenizer.json"))
    think, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    # the grammar holds for the answer; the model thinks first, steered to open its think
    # block and to close it soon (its reasoning is then <think> tokens, which it may hold)
    grammar = "start: /[a-z]{1,8}/"
    bias = {str(think): 100, str(end): 100}
    with served(qwen_checkpoint, load=load(qwen_checkpoint), chat_template=template) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        message = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, seed=0, logit_bias=bias,
            extra_body={"structured_outputs": {"grammar": grammar}}).choices[0].message
        assert re.fullmatch("(<think>)*", message.model_extra["reasoning_content"]), message
        assert re.fullmatch(r"\s*[a-z]{1,8}", message.content), message
        off = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, seed=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False},
                        "return_token_ids": True})
        prompt = tokenizer.decode(off.model_extra["prompt_token_ids"], skip_special_tokens=False)
        assert prompt.endswith("<think>\n\n</think>\n\n")
        assert off.choices[0].message.model_extra["reasoning_content"] is None
        # the Responses API: the reasoning a reasoning item before the message, whole and
        # streamed; vLLM's extensions (seed, structured_outputs) pass through
        extra = {"seed": 0, "structured_outputs": {"grammar": grammar}, "logit_bias": bias}
        response = client.responses.create(model="tiny", input=MESSAGES,
                                           max_output_tokens=40, extra_body=extra)
        reasoning, reply = response.output
        assert (reasoning.type, reply.type) == ("reasoning", "message")
        assert reasoning.content[0].text == message.model_extra["reasoning_content"]
        assert response.output_text == message.content
        events = list(client.responses.create(model="tiny", input=MESSAGES,
                                              max_output_tokens=40, extra_body=extra,
                                              stream=True))
        assert "".join(event.delta for event in events
                       if event.type == "response.reasoning_text.delta") == \
            reasoning.content[0].text
        assert events[-1].response.output_text == message.content


# vLLM's request fields ------------------------------------------------------------------


def greedy(client, **extra):
    return client.completions.create(model="tiny", prompt="The river runs", max_tokens=12,
                                     temperature=0, extra_body=extra).choices[0]


def test_min_tokens_holds_off_stop_tokens_and_strings(hermes):
    plain_choice = greedy(hermes, return_token_ids=True)
    first = plain_choice.model_extra["token_ids"][0]
    assert greedy(hermes, stop_token_ids=[first]).text == ""
    held = greedy(hermes, stop_token_ids=[first], min_tokens=3,
                  return_token_ids=True).model_extra["token_ids"]
    assert len(held) >= 3 and first not in held[:3]
    text = plain_choice.text
    stop = text[2:5]
    assert greedy(hermes, stop=[stop]).text == text[:text.index(stop)]
    assert greedy(hermes, stop=[stop], include_stop_str_in_output=True).text == \
        text[:text.index(stop) + len(stop)]
    assert greedy(hermes, stop=[stop], min_tokens=12).text == text


def test_bad_words_allowed_tokens_and_special_tokens(hermes, qwen_checkpoint):
    tokenizer = Tokenizer.from_file(str(qwen_checkpoint / "tokenizer.json"))
    ids = greedy(hermes, return_token_ids=True).model_extra["token_ids"]
    banned = tokenizer.decode(ids[:1])
    again = greedy(hermes, bad_words=[banned], return_token_ids=True).model_extra["token_ids"]
    assert tokenizer.encode(banned.lstrip(), add_special_tokens=False).ids[0] != again[0]
    allowed = list(range(40, 60))
    only = greedy(hermes, allowed_token_ids=allowed, return_token_ids=True).model_extra
    assert set(only["token_ids"]) <= set(allowed)
    start = tokenizer.token_to_id("<|im_start|>")
    forced = {"logit_bias": {str(start): 100}, "max_tokens": 2}
    skipped = hermes.completions.create(model="tiny", prompt="x", temperature=0,
                                        **forced).choices[0]
    kept = hermes.completions.create(model="tiny", prompt="x", temperature=0, **forced,
                                     extra_body={"skip_special_tokens": False}).choices[0]
    assert skipped.text == "" and kept.text == "<|im_start|><|im_start|>"


def test_prompt_logprobs_match_the_model(hermes, qwen_checkpoint):
    choice = greedy(hermes, prompt_logprobs=2, return_token_ids=True)
    prompt = choice.model_extra["prompt_token_ids"]
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    model = load_checkpoint(qwen_checkpoint).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits.float(), dim=-1)[0]
    for i in range(1, len(prompt)):
        mine = entries[i][str(prompt[i])]
        assert mine["logprob"] == pytest.approx(logprobs[i - 1, prompt[i]].item(), abs=1e-4)
        assert mine["rank"] == int((logprobs[i - 1] > logprobs[i - 1, prompt[i]]).sum()) + 1
        assert len(entries[i]) <= 3


def test_truncation_token_ids_request_ids_and_priority(hermes):
    full = greedy(hermes, return_token_ids=True).model_extra["prompt_token_ids"]
    cut = hermes.completions.create(model="tiny", prompt="The river runs", max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 2,
                                                "return_token_ids": True})
    assert cut.choices[0].model_extra["prompt_token_ids"] == full[-2:]
    assert cut.usage.prompt_tokens == 2
    chat = hermes.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                          extra_body={"request_id": "abc-1",
                                                      "return_token_ids": True})
    assert chat.id == "chatcmpl-abc-1"
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    assert hermes.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                          extra_body={"priority": 0}).choices
    with pytest.raises(openai.BadRequestError, match="priority") as refused:
        hermes.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                       extra_body={"priority": 1})
    assert refused.value.body["param"] == "priority"


def test_template_fields_render_as_transformers_does(hermes, qwen_checkpoint):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(qwen_checkpoint)
    chat = [*MESSAGES, {"role": "assistant", "content": "It is"}]

    def prompt_of(**extra) -> list[int]:
        reply = hermes.chat.completions.create(model="tiny", messages=chat, max_tokens=1,
                                               extra_body={**extra, "return_token_ids": True})
        return reply.model_extra["prompt_token_ids"]

    assert prompt_of(add_generation_prompt=False, continue_final_message=True) == \
        reference.apply_chat_template(chat, continue_final_message=True, tokenize=True,
                                      return_dict=False)
    assert prompt_of(add_generation_prompt=False) == reference.apply_chat_template(
        chat, add_generation_prompt=False, tokenize=True, return_dict=False)
    own = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
          "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
    shown = reference.decode(prompt_of(chat_template=own, documents=[{"text": "notes"}]))
    assert shown == "[user]What is 2 + 3?[assistant]It is<doc>notes</doc>"
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        prompt_of(continue_final_message=True)


def test_a_request_template_needs_the_servers_trust(qwen_checkpoint):
    with served(qwen_checkpoint, load=load(qwen_checkpoint)) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "chat_template": "{{ 'x' }}"})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "chat_template"


def test_structured_outputs_and_structural_tags(hermes, qwen_checkpoint):
    def chat(**extra):
        return hermes.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                              temperature=1.0, seed=3, extra_body=extra)

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    as_json = chat(structured_outputs={"json": schema}).choices[0].message.content
    jsonschema.validate(json.loads(as_json), schema)
    assert re.fullmatch("[0-9]{3}", chat(
        structured_outputs={"regex": "[0-9]{3}"}).choices[0].message.content)
    assert chat(structured_outputs={"choice": ["yes", "no"]}).choices[0].message.content in (
        "yes", "no")
    json.loads(chat(structured_outputs={"json_object": True}).choices[0].message.content)
    tag = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>", "schema": SCHEMAS["shout"], "end": "</tool_call>"}]}
    for extra in ({"response_format": tag}, {"structured_outputs": {
            "structural_tag": json.dumps(tag)}}):
        for seed in range(6):
            text = hermes.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
                extra_body=extra).choices[0].message.content
            for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
                jsonschema.validate(json.loads(body), SCHEMAS["shout"])
    for bad, param in (({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                        "structured_outputs"),
                       ({"structured_outputs": {"nope": 1}}, "structured_outputs.nope"),
                       ({"response_format": {"type": "structural_tag", "structures": []}},
                        "response_format")):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(**bad)
        assert refused.value.body["param"] == param


def test_models_retrieve_and_a_malformed_body(hermes):
    card = hermes.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError):
        hermes.models.retrieve("other")
    url = str(hermes.base_url).removesuffix("/")
    answer = httpx.post(f"{url}/chat/completions", content=b'{"model": "tiny", "messages": [',
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]


def test_fields_out_of_range_are_refused_by_name(hermes):
    rng = random.Random(0)
    for field, value in (("min_tokens", -1), ("bad_words", [""]),
                         ("allowed_token_ids", []), ("truncate_prompt_tokens", -2),
                         ("prompt_logprobs", 99), ("request_id", "a b"),
                         ("reasoning_effort", "extreme"),
                         ("allowed_token_ids", [10 ** 7])):
        with pytest.raises(openai.BadRequestError) as refused:
            hermes.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                           seed=rng.randrange(100), extra_body={field: value})
        assert field in refused.value.body["message"] + str(refused.value.body["param"])
