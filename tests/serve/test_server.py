"""The real server (uvicorn in a thread) through the official `openai` client and raw HTTP."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import openai
import pytest

from lathe.data.tokenizer import load_tokenizer
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from tests.serve.conftest import API_KEY, served, start_server, wait_healthy


def test_models_completions_and_usage(client, running):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    response = client.completions.create(model="tiny", prompt="The river", max_tokens=5,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + \
        response.usage.completion_tokens
    engine = running.engine()
    expected = engine.tokenizer.encode("The river", add_special_tokens=False).ids
    assert response.usage.prompt_tokens == len(expected)

    batch = client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=3,
                                      temperature=0, n=2, logprobs=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy, n=2
    assert all(len(c.logprobs.top_logprobs[0]) == 2 for c in batch.choices)
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3
    # the prompt tokens the prefix cache held: none the first time, its full blocks after
    long = list(range(40, 80))
    first, again = (client.completions.create(model="tiny", prompt=long, max_tokens=1)
                    for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = engine.block_manager.block_size
    assert again.usage.prompt_tokens_details.cached_tokens == (len(long) - 1) // block * block


def test_chat_through_the_checkpoint_template_and_seeds(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=3,
                                       temperature=1.0)
    b = client.chat.completions.create(model="tiny", messages=messages,
                                       max_completion_tokens=6, seed=3, temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant"
    assert a.usage.completion_tokens <= 6
    logprobs = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                              logprobs=True, top_logprobs=3, temperature=0)
    content = logprobs.choices[0].logprobs.content
    assert len(content) == logprobs.usage.completion_tokens
    assert len(content[0].top_logprobs) == 3


def test_tokenize_gives_the_ids_the_model_is_given_and_detokenize_reverses_them(running):
    """vLLM's /tokenize: a prompt as a completion takes it, a chat as the chat route renders
    it (its prompt_token_ids), with the count and the context; /detokenize turns ids back
    to text; bad bodies, ids and models are refused by name."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(f"{running.url}{path}", json=body, headers=auth, timeout=30)
    engine = running.engine()
    prompt = post("/tokenize", prompt="The river ran").json()
    ids = engine.tokenizer.encode("The river ran", add_special_tokens=True).ids
    assert prompt == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                      "token_strs": None}
    bare = post("/tokenize", model="tiny", prompt="The river ran", add_special_tokens=False,
                return_token_strs=True).json()
    assert bare["tokens"] == engine.tokenizer.encode("The river ran").ids
    assert bare["token_strs"] == [engine.tokenizer.id_to_token(i) for i in bare["tokens"]]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = post("/tokenize", messages=messages).json()
    served = post("/v1/chat/completions", model="tiny", messages=messages, max_tokens=1,
                  return_token_ids=True).json()
    assert chat["tokens"] == served["prompt_token_ids"]
    assert chat["count"] == served["usage"]["prompt_tokens"]
    unprompted = post("/tokenize", messages=messages, add_generation_prompt=False).json()
    assert chat["tokens"][:unprompted["count"]] == unprompted["tokens"] != chat["tokens"]
    assert post("/detokenize", tokens=chat["tokens"]).json() == {
        "prompt": engine.tokenizer.decode(chat["tokens"], skip_special_tokens=False)}
    vocab = engine.tokenizer.get_vocab_size(with_added_tokens=True)
    for path, body, status, message in (
            ("/detokenize", {"tokens": [5, vocab]}, 400, f"tokens: {vocab} is outside the "
                                                         "vocabulary"),
            ("/tokenize", {"prompt": "x", "temperature": 1}, 400, "temperature"),
            ("/tokenize", {"messages": messages, "continue_final_message": True}, 400,
             "continue_final_message and add_generation_prompt"),
            ("/tokenize", {"model": "other", "prompt": "x"}, 404, "`other` does not exist")):
        answer = post(path, **body)
        assert answer.status_code == status and message in answer.json()["error"]["message"]
    assert httpx.post(f"{running.url}/tokenize", json={"prompt": "x"}).status_code == 401


def test_responses_answer_as_the_chat_route_does_whole_and_streamed(client):
    """OpenAI's Responses API through the official client: the instructions and input are
    the chat, the output text, status and usage its reply's; the streamed events build the
    same text in order; a message-list input (a developer message, text parts) is the same
    chat; what a text server cannot do is a 400 naming the field."""
    kwargs = dict(model="tiny", input="Hi there", instructions="Be brief.",
                  max_output_tokens=6, temperature=0)
    response = client.responses.create(**kwargs)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi there"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.store is True and response.id.startswith("resp_")
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == f"response.{response.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events
                   if event.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text
    listed = client.responses.create(
        model="tiny", max_output_tokens=6, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hi there"}]}])
    assert listed.output_text == response.output_text
    assert listed.usage.input_tokens_details.cached_tokens > 0  # the same prompt, again
    # the next turn as an agent SDK sends it: the last response's output items back as
    # input, no state on the server
    again = client.responses.create(
        model="tiny", max_output_tokens=2, temperature=0, store=False,
        include=["reasoning.encrypted_content"], instructions="Be brief.",
        input=[{"role": "user", "content": "Hi there"},
               *(item.model_dump(exclude_none=True) for item in response.output),
               {"role": "user", "content": "And?"}])
    assert again.usage.input_tokens == client.chat.completions.create(
        model="tiny", max_tokens=1, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": response.output_text},
            {"role": "user", "content": "And?"}]).usage.prompt_tokens
    for extra, message in (
            ({"tools": [{"type": "web_search"}]}, "only function tools are served"),
            ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                      "image_url": "x"}]}]},
             "type='input_image' is not served"),
            ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
            ({"text": {"format": "json"}}, "text.format must be an object"),
            ({"input": [{"type": "reasoning", "content": 5}, {"type": "telepathy"}]},
             "input[1].type='telepathy' is not served"),
            ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role='robot'"),
            ({"extra_body": {"seed": -2**70}}, "seed")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{**kwargs, **extra})
        assert message in caught.value.body["message"]


def test_a_background_response_is_polled_and_cancelled_as_openais_is(client, running):
    """`background: true` answers at once, queued; the response polled until it ends is the
    one the foreground gives; cancelling ends a running one and its engine request (and
    returns an ended one as it is), deleting one ends it too; streaming, an unstored one, and
    cancelling a foreground one are 400s."""
    kwargs = dict(model="tiny", input="Hi there", instructions="Be brief.",
                  max_output_tokens=6, temperature=0)
    foreground = client.responses.create(**kwargs)
    queued = client.responses.create(**kwargs, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert client.responses.cancel(queued.id).status == done.status  # ended: as it is
    long = client.responses.create(model="tiny", input="Hi", max_output_tokens=220,
                                   temperature=0, background=True,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"
    deleted = client.responses.create(model="tiny", input="Hi", max_output_tokens=220,
                                      background=True, extra_body={"ignore_eos": True})
    client.responses.delete(deleted.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    while running.engine().num_running or running.engine().num_waiting:
        assert time.monotonic() < deadline, "a cancelled response's request kept running"
        time.sleep(0.02)
    for extra, message in (({"stream": True}, "not streamed"), ({"store": False}, "store")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**kwargs, background=True, **extra)
        assert message in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="not created in the background"):
        client.responses.cancel(foreground.id)


def test_stored_responses_continue_read_and_delete_as_openais_do(client):
    """`store` (OpenAI's default): previous_response_id continues a response — its input and
    output items before the new input, its instructions not carried over — exactly as the
    whole conversation sent again; a streamed response is stored too; GET reads one back,
    DELETE removes it, and a chain through a removed response is a 404 naming it;
    store=False keeps nothing."""
    first = client.responses.create(model="tiny", input="Hi there", instructions="Be brief.",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tiny", input="And?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    assert (first.store, second.previous_response_id) == (True, first.id)
    whole = client.responses.create(
        model="tiny", store=False, max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": "Hi there"},
               *(item.model_dump(exclude_none=True) for item in first.output),
               {"role": "user", "content": "And?"}])
    assert (second.usage.input_tokens, second.output_text) == (whole.usage.input_tokens,
                                                               whole.output_text)
    events = list(client.responses.create(model="tiny", input="More", stream=True,
                                          previous_response_id=second.id, max_output_tokens=2,
                                          temperature=0))
    third = events[-1].response
    assert third.usage.input_tokens > second.usage.input_tokens
    for response in (first, second, third):
        stored = client.responses.retrieve(response.id)
        assert (stored.output_text, stored.usage) == (response.output_text, response.usage)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="tiny", input="x", previous_response_id=third.id)
    assert f"no response with id '{second.id}'" in caught.value.body["message"]
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)


def test_a_stored_responses_input_items_list_as_openais_do(client):
    """GET /v1/responses/{id}/input_items: the request's own items (not the chain's), each
    with an id (the client's where it gave one) and its text as a content part; newest
    first, or oldest with order=asc; pages of `limit` after an item, which the official
    client walks through; a bad limit is a 400 naming it, an unknown response a 404."""
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    sent = [{"role": "user", "content": "One"},
            {"type": "message", "role": "assistant", "content": "Two", "id": "msg_mine"},
            {"role": "user", "content": [{"type": "input_text", "text": "Three"}]}]
    second = client.responses.create(model="tiny", input=sent, max_output_tokens=2,
                                     previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id)
    texts = [item.content[0].text for item in listed.data]
    assert texts == ["Three", "Two", "One"] and not listed.has_more
    assert listed.data[1].id == "msg_mine" and listed.data[1].role == "assistant"
    assert len({item.id for item in listed.data}) == 3
    pages = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [item.content[0].text for item in pages] == ["One", "Two", "Three"]  # 3 pages
    assert pages.has_more and pages.last_id == pages.data[0].id
    assert [item.content[0].text for item in client.responses.input_items.list(
        first.id).data] == ["Hi"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(second.id, limit=0)
    assert caught.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")


def test_streaming_with_and_without_the_usage_chunk(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}],
                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.usage is None for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    with_usage = list(client.completions.create(
        model="tiny", prompt="The", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in with_usage[:-1])


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_every_error_has_its_status_and_message(client, running):
    chat = [{"role": "user", "content": "Hi"}]
    bad_temperature = error_of(lambda: client.chat.completions.create(
        model="tiny", messages=chat, temperature=3.5))
    assert bad_temperature.status_code == 400
    assert "temperature=3.5 must be in [0, 2]" in bad_temperature.message
    bad_type = error_of(lambda: client.completions.create(model="tiny", prompt="x",
                                                          max_tokens="many"))
    assert bad_type.status_code == 400 and "max_tokens" in bad_type.message
    too_long = error_of(lambda: client.completions.create(model="tiny", prompt=[1] * 200,
                                                          max_tokens=100))
    assert too_long.status_code == 400
    assert "maximum context length is 256" in too_long.message
    assert "prompt has 200 tokens and max_tokens is 100" in too_long.message
    bad_role = error_of(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "robot", "content": "x"}]))
    assert bad_role.status_code == 400 and "role" in bad_role.message
    unknown_model = error_of(lambda: client.completions.create(model="gpt-9", prompt="x"))
    assert unknown_model.status_code == 404 and "gpt-9" in unknown_model.message
    no_key = openai.OpenAI(base_url=f"{running.url}/v1", api_key="wrong", max_retries=0)
    unauthorized = error_of(lambda: no_key.models.list())
    assert unauthorized.status_code == 401 and "API key" in unauthorized.message

    missing = httpx.get(f"{running.url}/v1/nothing-here")
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]
    huge = httpx.post(f"{running.url}/v1/completions", content=b"x" * 5000,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert huge.status_code == 413 and "4096" in huge.json()["error"]["message"]
    not_json = httpx.post(f"{running.url}/v1/completions", content=b"{nope",
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert not_json.status_code == 400


def left_mid_stream(running, path: str, body: dict) -> None:
    """A 240-token stream at `path` whose client reads one line and leaves: the request is
    aborted and its blocks freed, long before its tokens are all generated."""
    engine = running.engine()
    before = engine.outputs.generation_tokens_total
    with httpx.stream("POST", f"{running.url}{path}", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while engine.requests or engine.block_manager.usage > 0:
        assert time.monotonic() < deadline, "aborted request still holds blocks"
        time.sleep(0.01)
    assert engine.outputs.generation_tokens_total - before < 240


def test_disconnect_mid_stream_aborts_and_frees_blocks(running):
    left_mid_stream(running, "/v1/completions", {
        "model": "tiny", "prompt": "The river", "max_tokens": 240, "stream": True,
        "ignore_eos": True, "temperature": 0})


def test_a_responses_stream_the_client_leaves_aborts_and_frees_blocks(running):
    left_mid_stream(running, "/v1/responses", {
        "model": "tiny", "input": "The river", "max_output_tokens": 240, "stream": True,
        "ignore_eos": True, "temperature": 0})


def test_chat_cli_one_shot_against_the_server(client, running, capsys):
    from lathe.core.cli import main
    messages = [{"role": "user", "content": "Hi"}]
    expected = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                              temperature=0).choices[0].message.content
    assert main(["chat", running.url, "--prompt", "Hi", "--api-key", API_KEY,
                 "--temperature", "0", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_metrics_report_engine_state_and_latencies(client, running):
    client.completions.create(model="tiny", prompt="The", max_tokens=3)
    text = httpx.get(f"{running.url}/metrics").text
    for name in ("lathe:num_requests_running", "lathe:num_requests_waiting",
                 "lathe:kv_cache_usage_perc", "lathe:prefix_cache_queries_total",
                 "lathe:prefix_cache_hits_total", "lathe:num_preemptions_total",
                 "lathe:prompt_tokens_total", "lathe:generation_tokens_total",
                 "lathe:time_to_first_token_seconds_bucket",
                 "lathe:inter_token_latency_seconds_bucket",
                 "lathe:e2e_request_latency_seconds_count"):
        assert name in text, name
    engine = running.engine()
    reported = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("lathe:") and "{" in line}
    tensors = {t.data_ptr(): t for t in [*engine.model.parameters(), *engine.model.buffers()]}
    assert reported["lathe:weight_bytes"] == sum(t.numel() * t.element_size()
                                                 for t in tensors.values())  # tied: once
    assert reported["lathe:kv_cache_bytes"] == engine.slabs.nbytes > 0


def test_health_is_503_while_loading_and_a_full_queue_is_429(checkpoint):
    release = threading.Event()

    def slow_load() -> LLMEngine:
        release.wait(30)
        return LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=16))

    server, thread, url = start_server(checkpoint, slow_load, max_waiting=0)
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        release.set()
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        full = error_of(lambda: client.completions.create(model="tiny", prompt="x"))
        assert full.status_code == 429 and "max_waiting=0" in full.message
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_given_chat_template_and_its_variables_reach_the_prompt(checkpoint, tmp_path):
    """`lathe serve --chat-template FILE` renders the file, and a request's
    chat_template_kwargs (vLLM's) are its variables; lathe's own arguments are refused."""
    template = tmp_path / "terse.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "{% if terse %}Answer in one word.\n{% endif %}assistant:")
    with served(checkpoint, chat_template=template) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        engine_tokenizer = load_tokenizer(checkpoint)

        def prompt_tokens(**extra) -> int:
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                **extra).usage.prompt_tokens

        for terse in (False, True):
            text = "user: Hi\n" + ("Answer in one word.\n" if terse else "") + "assistant:"
            expected = len(engine_tokenizer.encode(text, add_special_tokens=False).ids)
            assert prompt_tokens(extra_body={"chat_template_kwargs": {"terse": terse}}) == \
                expected
        refused = error_of(lambda: prompt_tokens(
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}))
        assert refused.status_code == 400
        assert "chat_template_kwargs.add_generation_prompt: the server sets" in refused.message


def test_loading_and_every_engine_step_run_on_one_engine_thread(checkpoint):
    """All of the server's torch work — the load and each step — runs on the one
    `lathe-engine` thread (two OpenMP teams on a CPU slow each other down), never on the
    event loop's thread."""
    threads: set[str] = set()

    def load() -> LLMEngine:
        threads.add(threading.current_thread().name)
        engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=32))
        step = engine.step

        def recorded_step():
            threads.add(threading.current_thread().name)
            return step()
        engine.step = recorded_step
        return engine

    server, thread, url = start_server(checkpoint, load)
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for _ in range(3):
            client.completions.create(model="tiny", prompt="the cat", max_tokens=4)
        assert len(threads) == 1 and next(iter(threads)).startswith("lathe-engine")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_start_heap_is_frozen_while_serving_and_let_go_at_shutdown(checkpoint):
    gc.unfreeze()
    with served(checkpoint, engine=EngineConfig(num_blocks=64)) as url:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, the model, the app
        # what a full collection walks now: the objects made since, not the start's
        assert len(gc.get_objects()) < frozen // 10
        assert httpx.get(f"{url}/v1/models").status_code == 200
    assert gc.get_freeze_count() == 0


def test_max_model_len_is_what_models_reports_and_what_an_open_request_runs_to(checkpoint):
    """`--max-model-len` below the model's 256 positions: /v1/models reports it, a chat
    request without max_tokens generates up to it, and one asking past it is a 400 naming
    it."""
    with served(checkpoint, engine=EngineConfig(num_blocks=64, max_model_len=40)) as url:
        (model,) = httpx.get(f"{url}/v1/models").json()["data"]
        assert model["max_model_len"] == 40
        body = {"model": "tiny", "messages": [{"role": "user", "content": "the cat sat"}],
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        usage = reply["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 40
        assert reply["choices"][0]["finish_reason"] == "length"
        refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 40})
        assert refused.status_code == 400
        assert "maximum context length is 40 tokens" in refused.json()["error"]["message"]


def test_a_server_that_keeps_no_responses_says_so(checkpoint):
    """`--responses-store 0`: every response says store false, and previous_response_id
    is a 400 saying the server keeps none."""
    with served(checkpoint, engine=EngineConfig(num_blocks=32), responses_store=0) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        response = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="x", previous_response_id=response.id)
        assert "keeps no responses (--responses-store 0)" in caught.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
