"""Tool calling through the server with the official client: a checkpoint served with a
ChatML template and the hermes parser; `tool_choice="required"` and named calls are forced
by grammar and their arguments validate against the tool's schema, streamed or not; the
next turn takes the calls and their results. Each family's parser reads its own format,
streamed or whole, and gives back as text what is not a call."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from lathe.model import load_checkpoint, save_checkpoint
from lathe.serve.reasoning import reasoning_parser
from lathe.serve.structured import Literals, StructuredOutput
from lathe.serve.tool_calls import ToolStream, tool_call_parser
from tests.builders import (
    QWEN_REGEX,
    build_byte_level_tokenizer,
    build_sentencepiece_tokenizer,
    serve_model,
    split_then_bytes,
)
from tests.data.chat_templates import CHATML, GLM4, MISTRAL_ARGS, MISTRAL_NEMO, plain
from tests.serve.conftest import served, start_server, wait_healthy

ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": ADD}},
         {"type": "function", "function": {"name": "shout", "parameters": {
             "type": "object", "required": ["word"], "additionalProperties": False,
             "properties": {"word": {"enum": ["hi", "ho"]}}}}}]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def long_checkpoint(checkpoint, tmp_path_factory):
    """The serve checkpoint's tokenizer on a model with room for tool schemas, which
    ChatML renders into the prompt as JSON (plain text to this small tokenizer)."""
    vocab = load_checkpoint(checkpoint).config.vocab_size
    return save_checkpoint(serve_model(vocab, max_seq_len=1024),
                           tmp_path_factory.mktemp("tools") / "ckpt", tokenizer=checkpoint)


@pytest.fixture(scope="module")
def tool_server(long_checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chatml.jinja"
    template.write_text(plain(CHATML))
    server, thread, url = start_server(long_checkpoint, chat_template=template,
                                       tool_call_parser="hermes")
    wait_healthy(url)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    server.should_exit = True
    thread.join(timeout=10)


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_calls_are_well_formed_and_valid_over_seeds(tool_server):
    """One call each (a random model given room for several keeps calling until
    max_tokens; the parallel grammar is checked on the engine below)."""
    for seed in range(20):
        choice = tool_server.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
            assert call.id.startswith("call_") and call.type == "function"


def test_a_named_choice_calls_that_function_once(tool_server):
    choice = tool_server.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=96, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "shout"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "shout"
    assert json.loads(call.function.arguments)["word"] in ("hi", "ho")


def test_streamed_calls_match_the_unstreamed_response(tool_server):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=7)
    whole = tool_server.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in tool_server.chat.completions.create(**kwargs, stream=True)
              if c.choices]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        (whole.message.content or "")
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1


def test_a_streamed_reply_hands_out_each_call_as_it_completes(tool_server):
    """Parallel calls stream one by one, each whole as soon as it is complete (index, id,
    name and arguments in one delta), numbered in order, long before the reply ends; the
    openai client's stream helper puts together the unstreamed response's calls."""
    for seed in range(40):  # the first seed whose random reply makes several calls
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                      max_tokens=160, temperature=1.0, seed=seed)
        whole = tool_server.chat.completions.create(**kwargs).choices[0].message.tool_calls
        if len(whole) >= 2:
            break
    assert len(whole) >= 2
    chunks = [c for c in tool_server.chat.completions.create(**kwargs, stream=True)
              if c.choices]
    handed = [(at, call) for at, c in enumerate(chunks) for call in c.choices[0].delta.tool_calls
              or []]
    assert [call.index for _, call in handed] == list(range(len(whole)))
    assert [(c.id is not None, c.function.name, c.function.arguments) for _, c in handed] == \
        [(True, c.function.name, c.function.arguments) for c in whole]
    assert handed[0][0] < len(chunks) - 10  # the first call well before the last token
    with tool_server.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_the_next_turn_takes_the_calls_and_their_results(tool_server):
    first = tool_server.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0).choices[0].message
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": call.id, "content": "5"}
                 for call in first.tool_calls)]
    reply = tool_server.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                tool_choice="none", max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > tool_server.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
        max_tokens=1).usage.prompt_tokens


def test_responses_call_functions_and_take_their_outputs(tool_server):
    """The Responses API's flat function tools and named tool_choice: the forced call is the
    chat route's, as a function_call item (streamed as its arguments' deltas); the next turn
    takes the call and its function_call_output as the chat's tool call and tool message,
    sent whole or as the output alone after the stored response that made the call."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' flat form
    kwargs = dict(model="tiny", input="What is 2 + 3?", tools=tools, max_output_tokens=96,
                  temperature=0, tool_choice={"type": "function", "name": "add"})
    (call,) = [item for item in tool_server.responses.create(**kwargs).output
               if item.type == "function_call"]
    (chat,) = tool_server.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=96, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}}).choices[0].message.tool_calls
    assert (call.name, call.arguments, call.call_id) == ("add", chat.function.arguments,
                                                        call.call_id)
    jsonschema.validate(json.loads(call.arguments), ADD)
    events = list(tool_server.responses.create(**kwargs, stream=True))
    assert "".join(event.delta for event in events
                   if event.type == "response.function_call_arguments.delta") == call.arguments
    (added,) = [event.item for event in events if event.type == "response.output_item.added"]
    assert (added.type, added.name) == ("function_call", "add")
    turn = tool_server.responses.create(
        model="tiny", tools=tools, tool_choice="none", max_output_tokens=4, input=[
            {"role": "user", "content": "What is 2 + 3?"},
            {"type": "function_call", "call_id": call.call_id, "name": "add",
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
    assert turn.usage.input_tokens == tool_server.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none",
        max_tokens=1).usage.prompt_tokens
    # the agent loop on the server's memory: only the output goes back, after the response
    # that made the call
    called = tool_server.responses.create(**kwargs)
    stored_turn = tool_server.responses.create(
        model="tiny", tools=tools, tool_choice="none", max_output_tokens=4,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert stored_turn.usage.input_tokens == turn.usage.input_tokens


@pytest.mark.parametrize(("extra", "param", "named"), [
    ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     "names 'fly', which is not among the tools (add, shout)"),
    ({"tool_choice": "sometimes"}, "tool_choice", "is not one of none, auto, required"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools",
     "tools[0].function.name must be a non-empty string"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot constrain as well"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(tool_server, extra, param, named):
    with pytest.raises(openai.BadRequestError) as caught:
        tool_server.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                            **{"tools": TOOLS, **extra})
    assert named in caught.value.body["message"] and caught.value.body["param"] == param


def test_a_template_that_ignores_tools_is_refused(checkpoint, tmp_path):
    template = tmp_path / "no-tools.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                        "{% endfor %}")
    with served(checkpoint, chat_template=template) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=4)


CALLS = {  # format: (its parser, what the model writes, the text before the calls)
    "hermes": ("hermes", 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, '
               '"b": 3}}\n</tool_call>\n<tool_call>\n{"name": "shout", "arguments": {"word": '
               '"hi"}}\n</tool_call>', "Let me add."),
    "llama3_json": ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 2, '
                    '"b": 3}}; {"name": "shout", "parameters": {"word": "hi"}}', ""),
    "mistral": ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}, '
                '{"name": "shout", "arguments": {"word": "hi"}}]', ""),
    "mistral_args": ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]shout[ARGS]'
                     '{"word": "hi"}', ""),
    "qwen3_coder": ("qwen3_coder", "Adding.\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n"
                    "</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>\n"
                    "<tool_call>\n<function=shout>\n<parameter=word>\nhi\n</parameter>\n"
                    "</function>\n</tool_call>", "Adding."),
    "glm45": ("glm45", "\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
              "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>shout\n"
              "<arg_key>word</arg_key>\n<arg_value>hi</arg_value>\n</tool_call>", ""),
    "gemma4": ("gemma4", 'Adding.<|tool_call>call:add{a:2,b:3}<tool_call|><|tool_call>call:'
               'shout{word:<|"|>hi<|"|>}<tool_call|><|tool_response>', "Adding."),
    "glm47": ("glm47", "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b"
              "</arg_key><arg_value>3</arg_value></tool_call><tool_call>shout<arg_key>word"
              "</arg_key><arg_value>hi</arg_value></tool_call>", ""),
}


def parser_of(form: str):
    """The format's parser, bound to TOOLS (and, for Mistral's [ARGS] calls, to a template
    that writes them)."""
    parser = tool_call_parser(CALLS[form][0]).for_tools(TOOLS)
    return parser.for_template("[ARGS]") if form == "mistral_args" else parser


def streamed(parser, text: str, chunk: int, truncated: bool = False
             ) -> tuple[str, list, list[int]]:
    """`text` through a `ToolStream` in pieces of `chunk` characters: the text shown, the
    calls, and after how many characters each call was handed out."""
    stream, shown, calls, when = ToolStream(parser), [], [], []
    for i in range(0, len(text), chunk):
        out, new = stream.feed(text[i:i + chunk])
        shown.append(out)
        calls += new
        when += [min(i + chunk, len(text))] * len(new)
    rest, last = stream.finish(truncated)
    return "".join(shown) + rest, calls + last, when + [len(text) + 1] * len(last)


@pytest.mark.parametrize("form", sorted(CALLS))
def test_each_parser_reads_its_family_whole_and_streamed(form):
    parser = parser_of(form)
    _, text, content = CALLS[form]
    expected = [("add", {"a": 2, "b": 3}), ("shout", {"word": "hi"})]
    said, calls = parser.split(text)
    assert said == content and [(c.name, json.loads(c.arguments)) for c in calls] == expected
    shown, calls_streamed, when = streamed(parser, text, 3)
    assert shown.rstrip() == content
    assert [(c.name, c.arguments) for c in calls_streamed] == [(c.name, c.arguments)
                                                               for c in calls]
    # the first call is handed out before the reply ends, soon after its text is complete
    assert when[0] < len(text) - 10, when


@pytest.mark.parametrize("family", ["llama3_json", "hermes", "qwen3_coder"])
def test_a_long_streamed_call_is_read_a_few_times_not_at_every_closing_brace(family):
    """A tool call of ~100k characters (a file's text, thousands of "}" in its arguments)
    streamed four characters at a time: read a bounded number of times, each from where the
    calls read so far end — not once per piece, nor per "}" (each read costs the call so
    far) — and handed out whole."""
    code = "def f(x):\n    return {'a': [x]}\n" * 3000
    arguments = {"path": "a.py", "text": code}
    text = {"llama3_json": json.dumps({"name": "write", "parameters": arguments}),
            "hermes": "<tool_call>\n" + json.dumps({"name": "write", "arguments": arguments})
            + "\n</tool_call>",
            "qwen3_coder": "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>"
            "\n<parameter=text>\n" + code + "\n</parameter>\n</function>\n</tool_call>"}[family]
    parser = tool_call_parser(family)
    reads = []
    read_calls = parser.read_calls
    parser.read_calls = lambda region, at=0: reads.append(len(region) - at) or read_calls(
        region, at)
    shown, calls, _ = streamed(parser, text, 4)
    assert shown == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("write", arguments)]
    assert len(reads) < 60 and sum(reads) < 8 * len(text), (len(reads), sum(reads))


@pytest.mark.parametrize(("family", "text", "content", "names"), [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\nDone.',
     "\nDone.", ["add"]),
    ("hermes", 'Sure.<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><tool_call>'
     '\n{"name": "add", "arguments": [1]}\n</tool_call>',
     'Sure.<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>', ["add"]),
    ("qwen3_coder", "<tool_call>\n<function=add>\n</function>\n</tool_call> and then text",
     " and then text", ["add"]),
    ("gemma4", "<|tool_call>call:add{a:2}<tool_call|> and then text", " and then text",
     ["add"]),
    ("llama3_json", '{"name": "add", "parameters": {}}; {"answer": 4}', '; {"answer": 4}',
     ["add"]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {}}] and then text',
     " and then text", ["add"]),
])
def test_text_after_complete_calls_is_text_again(family, text, content, names):
    """The calls are read one after another; what follows the last complete one — text, a
    malformed call — comes back as text beside them (vLLM's streaming parsers do the same),
    streamed in any pieces as read whole."""
    parser = tool_call_parser(family).for_tools(TOOLS)
    said, calls = parser.split(text)
    assert (said, [c.name for c in calls]) == (content.rstrip(), names)
    for chunk in (1, 4, len(text)):
        shown, streamed_calls, _ = streamed(parser, text, chunk)
        assert shown.endswith(content) and [c.name for c in streamed_calls] == names


@pytest.mark.parametrize(("family", "text"), [
    ("hermes", "<tool_call>\n{\"name\": \"add\", \"arguments\": [1]}\n</tool_call>"),
    ("hermes", "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}"),  # never closed
    ("hermes", "Use <tool_ca"),
    ("llama3_json", "{not json at all"),
    ("mistral", "[TOOL_CALLS] {\"name\": \"add\"}"),
    ("mistral", "[TOOL_CALLS]add[ARGS]{\"a\": 2"),  # never closed
    ("mistral", "[TOOL_CALLS]two words[ARGS]{}"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"),
    ("glm45", "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2\n</tool_call>"),
    ("glm45", "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"),
    ("gemma4", "<|tool_call>call:add{a:2,b:3}"),  # never closed
    ("gemma4", '<|tool_call>call:add{a:two}<tool_call|>'),  # a string must be quoted
    ("gemma4", '<|tool_call>call:shout{word:<|"|>hi}<tool_call|>'),
    ("gemma4", "<|tool_call>call:two words{}<tool_call|>"),
    ("gemma4", "<|tool_call>call:add{" + "[" * 5000 + "]" * 5000 + "}<tool_call|>"),
])
def test_what_is_not_a_call_comes_back_as_text(family, text):
    parser = tool_call_parser(family).for_tools(TOOLS)
    assert parser.split(text) == (text, [])
    assert streamed(parser, text, 1)[:2] == (text, [])


TYPED = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "required": ["path", "lines"], "properties": {
        "path": {"type": "string"}, "lines": {"type": "integer"}, "exact": {"type": "boolean"},
        "span": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object", "properties": {"depth": {"type": "number"}}},
        "note": {"type": ["string", "null"]}}}}}, *TOOLS]
TYPED_CALLS = [("read_file", {"path": "src/a.py\n</parameter> is text", "lines": 30,
                              "exact": True, "span": [1, 2], "options": {"depth": 1.5},
                              "note": None}),
               ("add", {"a": 2, "b": 3})]
MARKERS = ["<|im_end|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
           "</arg_value>", "[TOOL_CALLS]", "[ARGS]", "</s>", "<s>", "<think>", "</think>",
           "<|tool_call>", "<tool_call|>", '<|"|>', "<|turn>", "<turn|>", "<|tool_response>",
           "<tool_response|>", "<|tool>", "<tool|>", "<|channel>", "<channel|>", "<|think|>"]


def trl_template(name: str) -> str:
    import trl
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


# parser: (the family's chat template, what ends its assistant turn)
TEMPLATES = {"qwen3_coder": [("qwen3_5_nothink", "<|im_end|>"), ("qwen3_6", "<|im_end|>"),
                             ("nemotron_3_nano", "<|im_end|>")],
             "glm45": [("glm4moe", None), ("GLM4", None)],
             "mistral": [("MISTRAL_ARGS", "</s>")],
             "gemma4": [("gemma4", "<|tool_response>"), ("gemma4_v5", "<|tool_response>")]}


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def marker_tokenizer(request, tmp_path_factory):
    """A tokenizer whose added tokens are the families' markers, as theirs are: Qwen's and
    GLM's byte-level shape, or Gemma's and Mistral's SentencePiece one (byte fallback)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    folder = tmp_path_factory.mktemp("markers")
    if request.param == "byte-level":
        build_byte_level_tokenizer(folder, split_then_bytes(QWEN_REGEX), MARKERS, [], {})
    else:
        build_sentencepiece_tokenizer(folder, prepend=False)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.add_special_tokens(MARKERS)
        tokenizer.save(str(folder / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>")


def admits(grammar: str, text: str, tokenizer) -> bool:
    """Whether `grammar` admits `text` as `tokenizer` splits it (markers as their tokens)."""
    from llguidance import LLMatcher, LLTokenizer, grammar_from
    backend = tokenizer.backend_tokenizer
    matcher = LLMatcher(LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(),
                                    eos_token=[tokenizer.eos_token_id]),
                        grammar if grammar.startswith("{") else grammar_from("lark", grammar),
                        log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokenizer.encode(
        text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize(("parser_name", "template", "end"), [
    (parser, *t) for parser, templates in TEMPLATES.items() for t in templates])
def test_calls_rendered_by_the_real_templates_read_back_and_fit_the_grammar(
        parser_name, template, end, marker_tokenizer):
    """transformers renders an assistant turn of typed calls with the family's template
    (TRL's copies of Qwen3.5's, Qwen3.6's, Nemotron 3's and GLM-4.5's); the turn reads back
    as those calls, whole and streamed, and the grammar that forces calls admits it."""
    source = trl_template(template) if template.islower() else plain(
        {"GLM4": GLM4, "MISTRAL_ARGS": MISTRAL_ARGS}[template])
    parser = tool_call_parser(parser_name).for_template(source).for_tools(TYPED)
    calls = [{"type": "function", "id": f"abcdefgh{i}", "function": {"name": name,
                                                                      "arguments": arguments}}
             for i, (name, arguments) in enumerate(TYPED_CALLS)]
    messages = [{"role": "user", "content": "Read it."},
                {"role": "assistant", "content": "", "tool_calls": calls}]

    def render(chat, prompt):
        return marker_tokenizer.apply_chat_template(
            chat, tools=TYPED, chat_template=source, tokenize=False,
            add_generation_prompt=prompt, enable_thinking=False)
    whole, prompt = render(messages, False), render(messages[:1], True)
    assert whole.startswith(prompt)
    # lathe's renderer (the server's and the trainers') writes the calls as transformers does
    from lathe.data.chat_template import ChatTemplate
    from lathe.data.messages import normalize_message, normalize_tools
    assert ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        [normalize_message(m, "m") for m in messages], False, normalize_tools(TYPED, "tools"),
        enable_thinking=False) == whole
    reply = whole[len(prompt):]
    reply = reply[:reply.rindex(end)] if end else reply
    reply = reply.split("</think>")[-1]
    content, read = parser.split(reply)
    assert content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in read] == TYPED_CALLS
    shown, calls, _ = streamed(parser, reply, 5)
    assert shown.strip() == "" and [c.arguments for c in calls] == [c.arguments for c in read]
    calls_text = reply[min(reply.index(m) for m in parser.markers if m in reply):].rstrip()
    grammar = parser.grammar(TYPED, 4, Literals.of(marker_tokenizer.backend_tokenizer)).grammar
    assert admits(grammar, calls_text, marker_tokenizer)
    wrong = calls_text.replace("30", "thirty", 1)
    assert "thirty" in wrong and not admits(grammar, wrong, marker_tokenizer)
    assert not admits(grammar, calls_text.replace("read_file", "rm_file", 1), marker_tokenizer)


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma4"])
def test_a_reasoning_model_reasons_before_its_constrained_answer(name, inside,
                                                                 marker_tokenizer):
    """With a reasoning parser a constraint holds for the answer: before it, the rest of
    the reasoning through its end where the reply starts inside it (DeepSeek-R1's
    prompts), else an optional think block (Qwen3's). </think> is a token here, so the
    reasoning may hold other tokens (Gemma 4's <channel|> too); Magistral's [/THINK] is text
    here, so it holds text."""
    literals = Literals.of(marker_tokenizer.backend_tokenizer)
    parser = reasoning_parser(name)
    prefix = parser.constraint_prefix(inside, literals, [marker_tokenizer.eos_token_id])
    schema = StructuredOutput(json=json.dumps(ADD), prefix=prefix).llguidance_grammar()
    forced = dataclasses.replace(tool_call_parser("hermes").grammar(TOOLS, 1, literals),
                                 prefix=prefix).llguidance_grammar()
    opened, end = "" if inside else parser.start, parser.end
    answer = '{"a":2,"b":3}'
    for reasoning in (f"Add them: <tool {{2}}.{end}\n\n", end):
        assert admits(schema, opened + reasoning + answer, marker_tokenizer)
    assert admits(schema, answer, marker_tokenizer) is not inside
    assert admits(schema, f"{opened}a </tool_call> b{end}{answer}", marker_tokenizer) \
        is (name != "mistral")
    assert not admits(schema, f"{opened}x{end}\n\nnot json", marker_tokenizer)
    assert not admits(schema, f"{opened}x{end}{end}{answer}", marker_tokenizer)
    assert not admits(schema, f"{opened}x</s>y{end}{answer}", marker_tokenizer)
    for other, said in ((StructuredOutput(choice=("yes", "no"), prefix=prefix), "no"),
                        (StructuredOutput(regex="[0-9]{2}", prefix=prefix), "42"),
                        (StructuredOutput(grammar='start: "ok"', prefix=prefix), "ok")):
        grammar = other.llguidance_grammar()
        assert admits(grammar, f"{opened}Hm.{end} {said}", marker_tokenizer)
        assert not admits(grammar, f"{opened}Hm.{end} maybe", marker_tokenizer)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert admits(forced, f"{opened}Plan.{end}\n\n{call}", marker_tokenizer)
    assert admits(forced, f"\n{opened}Plan.{end}\n{call}", marker_tokenizer)  # GLM's way
    assert not admits(forced, f"{opened}Plan.{end}\n\nNo call.", marker_tokenizer)


@pytest.mark.parametrize(("template", "parser"), [
    ("qwen2_5", "hermes"), ("qwen3", "hermes"), ("qwen3_instruct_2507", "hermes"),
    ("qwen3_5_think", "qwen3_coder"), ("qwen3_8", "qwen3_coder"),
    ("nemotron_3_nano", "qwen3_coder"), ("glm4moe", "glm45"), ("llama3_1", "llama3_json"),
    ("llama3_2", "llama3_json"), ("gemma3", None), ("phi3", None), ("llama3", None),
    ("deepseekv3", None), ("MISTRAL_ARGS", "mistral"), ("MISTRAL_NEMO", "mistral"),
    ("GLM47", "glm47"), ("lathe", "hermes"), ("gemma4", "gemma4"), ("gemma4_v2", "gemma4"),
    ("gemma4_v5", "gemma4")])
def test_a_template_implies_the_format_it_writes_calls_in(template, parser):
    """Without --tool-call-parser the server reads calls in the format its chat template
    writes them (TRL's copies of the families' templates; GLM-4.7's keeps a value next to
    its key); a template that writes no calls implies none."""
    from lathe.data.chat import CHAT_TEMPLATE
    from lathe.serve.tool_calls import template_tool_call_parser

    sources = {"MISTRAL_ARGS": plain(MISTRAL_ARGS), "MISTRAL_NEMO": plain(MISTRAL_NEMO),
               "GLM47": plain(GLM4).replace("</arg_key>\n<arg_value>",
                                            "</arg_key><arg_value>"),
               "lathe": CHAT_TEMPLATE}
    source = sources[template] if template in sources else trl_template(template)
    implied = template_tool_call_parser(source)
    assert (implied.name if implied is not None else None) == parser
    if template == "MISTRAL_ARGS":
        assert implied.named_args


def test_tools_without_a_format_are_a_400_naming_the_flag():
    """A template that writes no calls (or --tool-call-parser none) leaves the format
    unknown: a request with tools is a 400 that names the flag; tool_choice none renders."""
    from lathe.serve.config import ServerConfig
    from lathe.serve.protocol import ChatCompletionRequest, ProtocolError

    assert ServerConfig(checkpoint="x", tool_call_parser="none").tool_call_parser == "none"
    body = ChatCompletionRequest(model="tiny", tools=TOOLS, messages=MESSAGES)
    with pytest.raises(ProtocolError, match="--tool-call-parser") as raised:
        body.tool_plan(None, Literals({}), 8)
    assert raised.value.param == "tools"
    none = ChatCompletionRequest(model="tiny", tools=TOOLS, tool_choice="none",
                                 messages=MESSAGES).tool_plan(None, Literals({}), 8)
    assert none.parser is None and none.tools


def test_grammars_admit_the_calls_their_parser_reads(checkpoint):
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams

    engine = LLMEngine.from_checkpoint(checkpoint)
    literals = Literals.of(engine.tokenizer)
    for form in sorted(CALLS):
        parser = parser_of(form)
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured=parser.grammar(
                      TOOLS, 4 if s % 2 else 1, literals))
                  for s in range(8)]
        done = [d.outputs[0] for d in engine.generate(["The river"] * 8, params)]
        finished = [output for output in done if output.finish_reason == "stop"]
        assert len(finished) >= 4, (form, [o.text for o in done])
        for output in finished:
            _, calls = parser.split(output.text)
            assert calls, (form, output.text)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schema_of(call.name))


def test_lathe_chat_shows_the_calls_a_server_streams(tool_server):
    from lathe.serve.chat import RemoteChat, say

    url = str(tool_server.base_url).removesuffix("/v1/")
    chat = RemoteChat(url, model="tiny", tools=TOOLS)
    written: list[str] = []
    say(chat, MESSAGES, {"max_tokens": 96, "temperature": 0, "tool_choice": "required",
                         "parallel_tool_calls": False}, written.append)
    shown = "".join(written)
    name, arguments = shown.strip().removeprefix("[tool call ").removesuffix(")]").split("(", 1)
    assert name in ("add", "shout")
    jsonschema.validate(json.loads(arguments), schema_of(name))


def test_lathe_chat_runs_the_calls_and_sends_their_results_back(tool_server, monkeypatch):
    """`lathe chat --tool`: each call the server streams runs here and goes back as a tool
    message; a model forced to call at every turn is stopped after MAX_TOOL_TURNS rounds."""
    from lathe.data.tool_runner import ToolRunner
    from lathe.data.tools import load_tools
    from lathe.serve.chat import RemoteChat, say

    monkeypatch.setattr("lathe.serve.chat.MAX_TOOL_TURNS", 2)  # the context holds three

    url = str(tool_server.base_url).removesuffix("/v1/")
    chat = RemoteChat(url, model="tiny", tools=TOOLS[:1])
    written: list[str] = []
    with ToolRunner(load_tools(["tests.data.tools_for_tests:add"])) as runner:
        added = say(chat, MESSAGES, {"max_tokens": 96, "temperature": 0,
                                     "tool_choice": "required", "parallel_tool_calls": False},
                    written.append, runner)
    assert [m["role"] for m in added] == ["assistant", "tool"] * 3
    for call_message, result in zip(added[::2], added[1::2], strict=True):
        [call] = call_message["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert result == {"role": "tool", "tool_call_id": call["id"],
                          "content": str(arguments["a"] + arguments["b"])}
        assert f"[add -> {result['content']}]" in "".join(written)
    assert "stopped after" in written[-1]


def test_forcing_a_call_to_tools_past_the_grammar_limit_is_a_400_naming_tools():
    """`required` over tools whose schemas pass 64 KiB: the forcing grammar cannot be built;
    a 400 naming `tools` (it was a 500 that closed the connection)."""
    from lathe.serve.protocol import ChatCompletionRequest, ProtocolError

    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "x" * 2000,
        "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "y" * 200} for j in range(10)}}}}
        for i in range(40)]
    body = ChatCompletionRequest(model="tiny", tools=tools, tool_choice="required",
                                 messages=[{"role": "user", "content": "Go."}])
    with pytest.raises(ProtocolError, match="tools: the grammar that forces a call") as raised:
        body.tool_plan(tool_call_parser("hermes"), Literals({}), 8)
    assert raised.value.param == "tools"


FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", "<function=add>", "</function>",
             "<parameter=a>", "<parameter=word>", "</parameter>", "<arg_key>", "</arg_key>",
             "<arg_value>", "</arg_value>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[", "]",
             "<|python_tag|>", '{"name": "add", "arguments": {"a": 2, "b": 3}}',
             '{"name": "shout", "parameters": {"word": "hi"}}', '{"a": 1', "}", ";", ",",
             "add", "shout", "2", "hi", "True", "null", "é\U0001f600", "\\", '"', "<", ">"]


@pytest.mark.parametrize("form", sorted(CALLS))
def test_no_output_crashes_a_parser_and_a_stream_adds_up_to_the_whole(form):
    """Hostile model output, made of every format's markers and fragments: each parser
    reads it without raising, whole or cut (max_tokens), and what a stream shows plus what
    it returns at the end is what the whole reply gives."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    parser = parser_of(form)
    text = CALLS[form][1]  # the format's own calls, whole, halved and line by line
    example = text[min(text.index(m) for m in parser.markers if m in text):]
    own = [example] * 30 + [example[:len(example) // 2], example[len(example) // 2:]] * 8 \
        + example.split("\n")

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(st.lists(st.sampled_from(FRAGMENTS + own), max_size=8), st.integers(1, 9),
           st.booleans())
    def check(pieces, chunk, truncated):
        text = "".join(pieces)
        content, calls = parser.split(text, truncated)
        assert (content, calls) == (text, []) or calls
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
        shown, calls_streamed, _ = streamed(parser, text, chunk, truncated)
        assert [(c.name, c.arguments) for c in calls_streamed] == [(c.name, c.arguments)
                                                                   for c in calls]
        assert shown == (content if calls else text) or \
            (calls and shown.rstrip() == content.rstrip())

    check()


@pytest.mark.parametrize("inside", [False, True])
def test_a_reasoning_replys_stream_adds_up_to_the_whole_reply(inside):
    """Reasoning, answer and calls (Qwen3's markers and hermes calls, fragments of them in
    any order), streamed in chunks of any size: the reasoning and text the client was
    sent and the calls at the end are those of the whole reply read at once."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lathe.serve.replies import ReplyFormat, ReplyStream, whole_reply

    form = ReplyFormat(reasoning_parser("qwen3"), inside, parser_of("hermes"))
    pieces = ["<think>", "</think>", "\n", "plan ", "answer", "<thi", "nk>", "</th",
              CALLS["hermes"][1][CALLS["hermes"][1].index("<tool_call>"):], "<tool_call>"]

    @settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @given(st.lists(st.sampled_from(pieces), max_size=10), st.integers(1, 7),
           st.sampled_from(["stop", "length"]))
    def check(chosen, chunk, finish):
        text = "".join(chosen)
        whole = whole_reply(form, text, finish)
        stream = ReplyStream(form)
        sent = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
        end = stream.finish(finish)
        assert "".join(r for r, _, _ in sent) + (end.reasoning or "") == (whole.reasoning or "")
        assert "".join(c for _, c, _ in sent) + end.content == whole.content
        calls = [call for _, _, new in sent for call in new] + end.calls
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments)
                                                           for c in whole.calls]
        assert (end.finish_reason, stream.reasoning) == (whole.finish_reason, whole.reasoning)

    check()


GEMMA4_MARKERS = ["<turn|>", "<|turn>", "<|tool_call>", "<tool_call|>", '<|"|>',
                  "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", "<|channel>",
                  "<channel|>", "<|think|>"]


@pytest.fixture(scope="module")
def gemma4_checkpoint(tmp_path_factory):
    """A Gemma 4 instruct checkpoint's shape: its SentencePiece-shaped tokenizer with its
    turn, channel and tool markers special tokens, the chat template it shipped with, and
    its end tokens (<turn|>, and <|tool_response>, where a turn of calls ends) in
    generation_config.json."""
    from tokenizers import Tokenizer

    from lathe.model import Transformer
    from lathe.model.config import ModelConfig
    folder = tmp_path_factory.mktemp("gemma4")
    build_sentencepiece_tokenizer(folder / "tok", end_of_turn="<turn|>", prepend=False)
    tokenizer = Tokenizer.from_file(str(folder / "tok" / "tokenizer.json"))
    tokenizer.add_special_tokens(GEMMA4_MARKERS)
    tokenizer.save(str(folder / "tok" / "tokenizer.json"))
    (folder / "tok" / "chat_template.jinja").write_text(trl_template("gemma4_v5"))
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(
        "tiny", family="gemma4_text", vocab_size=tokenizer.get_vocab_size(), n_layers=2,
        max_seq_len=2048))
    out = save_checkpoint(model, folder / "ckpt", tokenizer=folder / "tok")
    ends = [tokenizer.token_to_id(t) for t in ("<turn|>", "<|tool_response>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return out


def test_a_gemma4_checkpoint_calls_tools_through_the_server(gemma4_checkpoint):
    """Served with nothing named, Gemma 4's template implies its tool-call and reasoning
    formats: a required call is forced in its notation and comes back as OpenAI's calls,
    valid against the tool's schema, alike streamed; the next turn renders the calls and
    their results through the template."""
    with served(gemma4_checkpoint) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        asked = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                     max_tokens=300, temperature=1.0, seed=3)
        reply = client.chat.completions.create(**asked)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
        streamed = {}
        for chunk in client.chat.completions.create(**asked, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                streamed.setdefault(delta.index, []).append(delta.function)
        assert [(parts[0].name, "".join(p.arguments or "" for p in parts))
                for _, parts in sorted(streamed.items())] == \
            [(c.function.name, c.function.arguments) for c in calls]
        follow = [*MESSAGES, choice.message.model_dump(exclude_none=True),
                  *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls)]
        after = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS,
                                               max_tokens=4)
        assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
