"""A property-based fuzz of the real server's generating endpoints (completions, chat,
Responses): every request field is drawn from its whole type — 64-bit and bigger
integers, NaN and infinities, long and nested lists, values of the wrong type, unknown
keys — and raw bodies that are not JSON at all.
Whatever arrives, the server answers without a 5xx, the engine stays alive and ends idle,
and the next ordinary request is served.
"""

from __future__ import annotations

import json
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

# The edges of every integer type a field could be stored in, just past them, and the
# limits of the fields themselves. Hypothesis draws the first entries of a list most
# often, so the values that break fixed-width storage come first.
EDGES = [2**63, -(2**63) - 1, 2**64, 2**63 - 1, -(2**63), 2**31, 2**31 - 1, -(2**31), 2**32,
         2**53 + 1, 10**30, -1, 0, 1, 2, 15, 16, 17, 20, 21, 255, 256, 257, 511, 512]
integers = st.one_of(st.sampled_from(EDGES), st.integers())
floats = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e-40, 1e308,
                                    -0.0, 0.0, 1e-5, 0.5, 1.0, 2.0, 2.0000001]),
                   st.floats(allow_nan=True, allow_infinity=True))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "\n", "</s>", "<|im_end|>",
                                                         "tiny", "\x00", "\ud800"]))
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), integers, floats, texts),
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12)
token_lists = st.lists(integers, max_size=300)


def typed(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """A field's own type most of the time, anything at all otherwise."""
    return st.one_of(strategy, strategy, strategy, junk)


SHARED = {
    "temperature": typed(floats), "top_p": typed(floats), "top_k": typed(integers),
    "min_p": typed(floats), "n": typed(integers), "seed": typed(integers),
    "presence_penalty": typed(floats), "frequency_penalty": typed(floats),
    "repetition_penalty": typed(floats),
    "stop": typed(st.one_of(texts, st.lists(texts, max_size=20))),
    "stop_token_ids": typed(token_lists),
    "logit_bias": typed(st.dictionaries(st.one_of(integers.map(str), texts), floats,
                                        max_size=30)),
    "stream": typed(st.booleans()),
    "stream_options": typed(st.fixed_dictionaries({}, optional={
        "include_usage": typed(st.booleans())})),
    "ignore_eos": typed(st.booleans()), "user": typed(texts),
    "max_tokens": typed(integers),
    "response_format": typed(st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.dictionaries(
            st.sampled_from(["name", "schema", "strict"]), junk)}))),
    "guided_json": typed(st.one_of(texts, st.dictionaries(texts, junk, max_size=4))),
    "guided_regex": typed(st.one_of(texts, st.sampled_from(["[0-9]+", "(+", "a{999999}"]))),
    "guided_choice": typed(st.lists(texts, max_size=5)),
    "guided_grammar": typed(st.one_of(texts, st.just('start: "a"+'))),
    "structured_outputs": typed(st.dictionaries(st.sampled_from(
        ["json", "regex", "choice", "grammar", "json_object", "structural_tag",
         "disable_any_whitespace", "whitespace_pattern"]), junk, max_size=3)),
    "min_tokens": typed(integers), "bad_words": typed(st.lists(texts, max_size=4)),
    "allowed_token_ids": typed(token_lists), "prompt_logprobs": typed(integers),
    "include_stop_str_in_output": typed(st.booleans()),
    "skip_special_tokens": typed(st.booleans()),
    "spaces_between_special_tokens": typed(st.booleans()),
    "truncate_prompt_tokens": typed(integers), "return_token_ids": typed(st.booleans()),
    "priority": typed(integers), "request_id": typed(texts),
    "add_special_tokens": typed(st.booleans()),
}
COMPLETION = {
    **SHARED, "prompt": typed(st.one_of(texts, st.lists(texts, max_size=3), token_lists,
                                        st.lists(token_lists, max_size=3))),
    "logprobs": typed(integers), "echo": typed(st.booleans()),
    "best_of": typed(integers), "suffix": typed(texts),
}
messages = st.lists(st.fixed_dictionaries(
    {"role": typed(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={"content": typed(st.one_of(texts, st.lists(st.fixed_dictionaries(
        {"type": typed(st.just("text")), "text": typed(texts)}), max_size=3))),
              "name": texts}), max_size=4)
CHAT = {
    **SHARED, "messages": typed(messages), "max_completion_tokens": typed(integers),
    "logprobs": typed(st.booleans()), "top_logprobs": typed(integers),
    "tools": junk, "tool_choice": junk, "parallel_tool_calls": typed(st.booleans()),
    "chat_template_kwargs": typed(st.dictionaries(texts, junk, max_size=4)),
    "add_generation_prompt": typed(st.booleans()),
    "continue_final_message": typed(st.booleans()), "chat_template": typed(texts),
    "documents": typed(st.lists(st.dictionaries(texts, texts, max_size=2), max_size=2)),
    "reasoning_effort": typed(st.sampled_from(["low", "high", "extreme"])),
    "include_reasoning": typed(st.booleans()),
}


items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": typed(st.sampled_from(["user", "assistant", "developer"])),
                           "content": typed(st.one_of(texts, st.lists(st.fixed_dictionaries(
                               {"type": typed(st.sampled_from(["input_text", "output_text"])),
                                "text": typed(texts)}), max_size=2)))}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                    "reasoning", "message"])},
                          optional={"call_id": typed(texts), "name": typed(texts),
                                    "arguments": typed(texts), "output": junk,
                                    "content": junk, "summary": junk}),
    junk), max_size=4)
RESPONSES = {
    "input": typed(st.one_of(texts, items)), "instructions": typed(texts),
    "tools": junk, "tool_choice": junk, "parallel_tool_calls": typed(st.booleans()),
    "max_output_tokens": typed(integers), "temperature": typed(floats),
    "top_p": typed(floats), "text": junk, "reasoning": junk, "stream": typed(st.booleans()),
    "store": typed(st.booleans()), "metadata": junk, "user": typed(texts),
    "previous_response_id": typed(texts), "background": typed(st.booleans()),
    "truncation": typed(texts), "include": junk, "top_logprobs": typed(integers),
    "service_tier": typed(texts), "seed": typed(integers), "top_k": typed(integers),
    "structured_outputs": SHARED["structured_outputs"],
}


def bodies(fields: dict[str, st.SearchStrategy], base: dict) -> st.SearchStrategy:
    """A request that is valid but for one to three drawn fields, so that most drawn
    values reach the engine; one in ten also carries an unknown key."""
    names = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)
    drawn = names.flatmap(lambda keys: st.fixed_dictionaries({key: fields[key] for key in keys}))
    unknown = st.tuples(st.sampled_from([False] * 9 + [True]),
                        st.dictionaries(texts, junk, min_size=1, max_size=1))
    return st.tuples(drawn, unknown).map(
        lambda parts: {**base, **(parts[1][1] if parts[1][0] else {}), **parts[0]})


requests = st.one_of(
    bodies(COMPLETION, {"model": "tiny", "prompt": "The river", "max_tokens": 3}).map(
        lambda body: ("/v1/completions", body)),
    bodies(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 3}).map(lambda body: ("/v1/chat/completions", body)),
    bodies(RESPONSES, {"model": "tiny", "input": "Hi", "max_output_tokens": 3}).map(
        lambda body: ("/v1/responses", body)))
raw_bodies = st.one_of(st.binary(max_size=64), st.sampled_from([
    b"", b"{", b"[]", b"3", b"null", b'"text"', b"{}", b"\xff\xfe", b'{"model": "tiny"}',
    b"[" * 5000 + b"]" * 5000, b'{"model": "tiny", "prompt": "x"' + b"]" * 1000,
    b'{"model": "tiny", "prompt": "x", "prompt": [1]}', b'{"model": "tiny", "prompt": 1e999}',
    b'{"model": "tiny", "prompt": "x", "top_k": 9223372036854775808}']))


def encode(body: object) -> bytes:
    # NaN and Infinity as Python's json writes them: the server's JSON parser reads them
    text = json.dumps(body, allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def send(client: httpx.Client, path: str, content: bytes) -> None:
    """Send one body; the answer must be no 5xx, a stream must carry no error that the
    server would only give for its own fault, and the engine must still be alive."""
    with client.stream("POST", path, content=content, headers=AUTH) as response:
        text = response.read().decode("utf-8", "replace")
    assert response.status_code < 500, (content[:300], response.status_code, text[:300])
    assert "internal error" not in text and "internal_server_error" not in text, (
        content[:300], text[:300])
    health = client.get("/health")
    assert health.status_code == 200, (content[:300], health.text)


FUZZ = settings(max_examples=600, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def assert_idle_and_serving(running) -> None:
    engine = running.engine()
    deadline = time.monotonic() + 10
    while engine.requests or engine.block_manager.usage > 0:
        assert time.monotonic() < deadline, "a fuzzed request still holds the engine"
        time.sleep(0.01)
    ok = httpx.post(f"{running.url}/v1/completions", headers=AUTH, json={
        "model": "tiny", "prompt": "The", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text


def test_fuzzed_requests_never_break_the_server(running):
    sent = []

    @FUZZ
    @given(request=requests)
    def one(request: tuple[str, dict]) -> None:
        sent.append(request)
        send(client, request[0], encode(request[1]))

    with httpx.Client(base_url=running.url, timeout=60) as client:
        one()
    assert_idle_and_serving(running)
    print(f"fuzz: {len(sent)} requests sent")
    assert len(sent) >= 600


def test_fuzzed_raw_bodies_never_break_the_server(running):
    sent = []

    @settings(FUZZ, max_examples=100)
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]),
           content=raw_bodies)
    def one(path: str, content: bytes) -> None:
        sent.append(content)
        send(client, path, content)

    with httpx.Client(base_url=running.url, timeout=60) as client:
        one()
    assert_idle_and_serving(running)
    assert len(sent) >= 100
