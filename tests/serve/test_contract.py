"""The server's contract with hostile and unusual clients: each bad request gets a 4xx
naming the field and the server keeps serving; echo gives prompt log-probabilities;
bodies, disconnects, keys and broken engines are handled (the real server, raw HTTP)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.data.chat_template import read_chat_template
from lathe.kernels import cpu_native
from lathe.model.checkpoint import CheckpointError
from lathe.serve.commands import serve_main
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling_params import SamplingParams
from tests.serve.conftest import API_KEY, start_server, wait_healthy

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(running, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{running.url}{path}", content=content,
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=timeout)


def assert_alive(running) -> None:
    ok = post(running, "/v1/completions", {"model": "tiny", "prompt": "The", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{running.url}/health").status_code == 200


def error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    return response.json()["error"]["message"]


@pytest.mark.parametrize("seed", [18446744073709551615, 2**64, -(2**63) - 1])
def test_a_seed_past_64_bits_is_a_400_and_the_engine_lives_on(running, seed):
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "x"}]})):
        message = error(post(running, path, {"model": "tiny", "seed": seed, **extra}))
        assert f"seed={seed} must be in [{-2**63}, {2**63 - 1}]" in message
    assert_alive(running)


def test_a_prompt_longer_than_the_token_budget_runs(running):
    engine = running.engine()
    assert engine.config.max_num_batched_tokens == 64
    prompt = [9] * 200
    response = post(running, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    with torch.inference_mode():
        ids = list(prompt)
        for _ in range(3):
            ids.append(int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert response.json()["choices"][0]["text"] == engine.tokenizer.decode(ids[200:])


def test_echo_with_logprobs_returns_the_prompt_scored_as_lm_eval_reads_it(running):
    engine = running.engine()
    prompt = engine.encode("The river ran past the old mill")
    with torch.inference_mode():
        reference = torch.log_softmax(engine.model(torch.tensor([prompt])).logits[0], -1)
    for max_tokens in (1, 0):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "logprobs": 1,
                "echo": True, "temperature": 0}
        choice = post(running, "/v1/completions", body).json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for t in range(1, len(prompt)):
            expected = float(reference[t - 1, prompt[t]])
            assert logprobs["token_logprobs"][t] == pytest.approx(expected, abs=1e-4)
            top = logprobs["top_logprobs"][t]  # the best token, and the prompt's own
            assert max(top.values()) == pytest.approx(float(reference[t - 1].max()), abs=1e-4)
            assert engine.tokenizer.decode([prompt[t]]) in top
        assert choice["text"].startswith(engine.tokenizer.decode(prompt))
    assert choice["text"] == engine.tokenizer.decode(prompt)  # max_tokens=0: nothing added
    text = post(running, "/v1/completions", {"model": "tiny", "prompt": "The river",
                                             "max_tokens": 2, "echo": True}).json()
    assert text["choices"][0]["text"].startswith("The river")


def test_echo_scores_a_prompt_of_the_whole_context(running):
    """echo with max_tokens=0 only scores the prompt: one of exactly the context length is
    served (the token drawn and dropped needs no position or KV slot), one token more is
    not, and neither is generating one more token after it."""
    engine = running.engine()
    window = engine.max_model_len
    prompt = (engine.encode("The river ran past the old mill. ") * window)[:window]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True}
    scored = post(running, "/v1/completions", body)
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["tokens"]) == window
    for refused in ({**body, "prompt": prompt + prompt[:1]}, {**body, "max_tokens": 1}):
        response = post(running, "/v1/completions", refused)
        assert response.status_code == 400
        assert "maximum context length" in response.json()["error"]["message"]


def test_logprobs_zero_still_names_the_sampled_token(running):
    body = {"model": "tiny", "prompt": "The", "max_tokens": 3, "logprobs": 0}
    logprobs = post(running, "/v1/completions", body).json()["choices"][0]["logprobs"]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                 logprobs["top_logprobs"], strict=True):
        assert top == {token: value}


def test_logit_bias_through_the_api(running):
    engine = running.engine()
    token = engine.encode(" river")[0]
    body = {"model": "tiny", "prompt": "The", "max_tokens": 4, "temperature": 0,
            "logit_bias": {str(token): 100}}
    choice = post(running, "/v1/completions", body).json()["choices"][0]
    assert choice["text"] == engine.tokenizer.decode([token] * 4)
    message = error(post(running, "/v1/completions", {**body, "logit_bias": {"5": 250}}))
    assert "logit_bias" in message and "[-100, 100]" in message
    assert "outside the vocabulary" in error(post(running, "/v1/completions", {
        **body, "logit_bias": {"99999": 1}}))


SURROGATE = b'"\\ud800"'


@pytest.mark.parametrize("where,body", [
    ("prompt", b'{"model": "tiny", "prompt": ' + SURROGATE + b'}'),
    ("model", b'{"model": ' + SURROGATE + b', "prompt": "x"}'),
    ("stop", b'{"model": "tiny", "prompt": "x", "stop": [' + SURROGATE + b']}'),
    ("messages[0].content", b'{"model": "tiny", "messages": [{"role": "user", "content": '
     + SURROGATE + b'}]}'),
])
def test_lone_surrogates_are_a_400_naming_where(running, where, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    message = error(post(running, path, body))
    assert "surrogate" in message and where.split("[")[0] in message


@pytest.mark.parametrize("part,named", [
    ({"type": "text", "text": None}, "messages[0].content[0].text must be a string"),
    ({"type": "text", "text": 7}, "messages[0].content[0].text must be a string"),
    ({"type": "text", "text": ["a"]}, "messages[0].content[0].text must be a string"),
    ({"type": "image_url", "image_url": {"url": "x"}}, "'image_url' are not supported"),
    ("just a string", "'str' are not supported"),
])
def test_content_parts_other_than_text_strings_are_a_400(running, part, named):
    body = {"model": "tiny", "messages": [{"role": "user", "content": [part]}]}
    assert named in error(post(running, "/v1/chat/completions", body))


@pytest.mark.parametrize("field,value,named", [
    ("tools", [{"type": "function", "function": "f"}], "tools[0] must be {\"type\""),
    ("tool_choice", "auto", "tool_choice='auto' needs tools"),
    ("response_format", {"type": "json_schema"}, "response_format.json_schema must be"),
    ("functions", [{"name": "f"}], "functions: function calling"),
    ("frobnicate", 1, "unknown parameter `frobnicate`"),
    ("max_completion_tokens", 0, "max_completion_tokens=0 must be in [1, 2147483647]"),
    ("max_tokens", 0, "max_tokens=0 must be in [1, 2147483647]"),
    ("top_k", 2**63, f"top_k={2**63} must be in [-1, 2147483647]"),
    ("temperature", 1e999, "temperature: Input should be a finite number"),
    ("stop_token_ids", [5, -1], "stop_token_ids.1=-1 must be in [0, 2147483647]"),
    ("top_logprobs", 3, "top_logprobs needs logprobs=true"),
])
def test_unsupported_chat_fields_are_a_400_naming_them(running, field, value, named):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], field: value}
    response = post(running, "/v1/chat/completions", body)
    assert named in error(response)
    assert response.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize("field,value,named", [
    ("suffix", "end", "suffix: insertion"),
    ("best_of", 3, "best_of=3 is not supported"),
    ("max_tokens", 0, "max_tokens=0 generates nothing"),
    ("max_tokens", -1, "max_tokens: Input should be greater than or equal to 0"),
])
def test_unsupported_completion_fields_are_a_400_naming_them(running, field, value, named):
    body = {"model": "tiny", "prompt": "x", field: value}
    assert named in error(post(running, "/v1/completions", body))


def test_harmless_fields_pass_developer_is_system_and_tool_the_template_refuses(running):
    plain = {"model": "tiny", "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"}]}
    expected = post(running, "/v1/chat/completions", plain).json()
    harmless = {**plain, "user": "u-1", "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "temperature": None, "top_p": None,
                "messages": [{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    got = post(running, "/v1/chat/completions", {**harmless, "temperature": 0}).json()
    assert got["choices"][0]["message"] == expected["choices"][0]["message"]
    tool = {**plain, "messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}
    assert post(running, "/v1/chat/completions", tool).status_code == 200  # a tool turn
    unknown = {**plain, "messages": [{"role": "user", "content": "Hi", "mood": "ok"}]}
    assert "messages[0].mood is not a field of a user message" in error(post(
        running, "/v1/chat/completions", unknown))


def test_the_body_limit_counts_bytes_read_even_when_chunked(running):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    response = httpx.post(f"{running.url}/v1/completions", content=chunks(),
                          headers={**AUTH, "Content-Type": "application/json"})
    assert "4096" in error(response, 413)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers  # nothing declared up front
    assert_alive(running)


def test_a_non_streaming_client_that_disconnects_is_aborted(running, monkeypatch):
    engine = running.engine()
    step = engine.step

    def slow_step():  # 200 steps take a second or more, so the close lands mid-request
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before = engine.outputs.generation_tokens_total
    body = json.dumps({"model": "tiny", "prompt": "The river", "max_tokens": 200, "n": 8,
                       "ignore_eos": True, "temperature": 1.0}).encode()
    host, port = running.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while engine.outputs.generation_tokens_total - before < 8:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    deadline = time.monotonic() + 10
    while engine.requests or engine.block_manager.usage > 0:
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.01)
    assert engine.outputs.generation_tokens_total - before < 8 * 200


def test_the_key_is_checked_for_every_route_but_health_in_any_scheme_case(running):
    for scheme in ("Bearer", "bearer", "BEARER"):
        ok = httpx.get(f"{running.url}/v1/models",
                       headers={"Authorization": f"{scheme} {API_KEY}"})
        assert ok.status_code == 200
    for header in ({}, {"Authorization": f"Basic {API_KEY}"},
                   {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": API_KEY}):
        assert httpx.get(f"{running.url}/v1/models", headers=header).status_code == 401
    assert httpx.get(f"{running.url}/openapi.json").status_code == 401
    assert httpx.get(f"{running.url}/openapi.json", headers=AUTH).json()["info"]["title"] == \
        "lathe"
    assert httpx.get(f"{running.url}/docs").status_code == 404
    assert httpx.get(f"{running.url}/metrics").status_code == 200  # open unless protected
    assert httpx.get(f"{running.url}/health").status_code == 200


def test_protect_metrics_puts_them_behind_the_key(checkpoint):
    server, thread, url = start_server(
        checkpoint, lambda: LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=16)),
        api_key=API_KEY, protect_metrics=True)
    try:
        wait_healthy(url)
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert "lathe:num_requests_running" in httpx.get(f"{url}/metrics", headers=AUTH).text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_protect_metrics_without_a_key_is_refused_at_start(checkpoint, monkeypatch):
    monkeypatch.delenv("LATHE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--protect-metrics needs --api-key"):
        serve_main([str(checkpoint), "--protect-metrics"])


def test_an_engine_failure_turns_health_503_and_requests_fail_fast(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=16))
    server, thread, url = start_server(checkpoint, lambda: engine)
    try:
        wait_healthy(url)
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("CUDA error: device lost"))
        body = {"model": "tiny", "prompt": "The", "max_tokens": 4}
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert failed.status_code == 503 and "device lost" in failed.json()["error"]["message"]
        streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True},
                              timeout=10)
        assert streamed.status_code == 503  # refused before the stream opens
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "must be restarted" in health.json()["status"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive(), "the server did not shut down after the engine failed"


def test_a_request_the_engine_refuses_at_admission_fails_alone(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=32))
    add = engine.add_request

    def refuse_long_prompts(prompt_ids, params, request_id=None, adapter=None, checked=False):
        if len(prompt_ids) > 20:  # stands in for any per-request failure at admission
            raise ValueError("this prompt cannot be admitted")
        return add(prompt_ids, params, request_id, adapter, checked)

    engine.add_request = refuse_long_prompts
    server, thread, url = start_server(checkpoint, lambda: engine)
    try:
        wait_healthy(url)
        results = {}

        def send(name: str, prompt: list[int], stream: bool = False) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": stream}
            results[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=send, args=args) for args in (
            ("bad", [5] * 30), ("good", [5] * 5), ("bad-stream", [5] * 30, True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["good"].status_code == 200
        assert results["bad"].status_code == 500
        assert '"error"' in results["bad-stream"].text
        assert results["bad-stream"].text.rstrip().endswith("data: [DONE]")
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_served_request_is_checked_once_and_a_list_of_prompts_all_or_none(checkpoint,
                                                                          monkeypatch):
    """The front end checks each prompt once, before any is queued; the core takes them as
    checked; one prompt that cannot fit fails the whole call, leaving nothing queued."""
    from lathe.serve.request_checks import RequestLimits
    checked = []
    check = RequestLimits.check
    monkeypatch.setattr(RequestLimits, "check",
                        lambda self, ids, params: (checked.append(len(ids)),
                                                   check(self, ids, params))[1])
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=32))
    server, thread, url = start_server(checkpoint, lambda: engine)
    try:
        wait_healthy(url)
        body = {"model": "tiny", "prompt": [[5] * 3, [5] * 4], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        assert sorted(checked) == [3, 4]
        body["prompt"] = [[5] * 3, [5] * (engine.max_model_len + 1)]
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 400 and "maximum context length" in answer.text
        assert engine.num_waiting == engine.num_running == 0 and not engine.requests
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def broken_copy(checkpoint, tmp_path, name: str, change) -> object:
    folder = tmp_path / name
    shutil.copytree(checkpoint, folder)
    change(folder)
    return folder


def test_serving_load_errors_name_the_file_and_the_problem(checkpoint, tmp_path):
    def corrupt_tokenizer(folder):
        (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')

    def bad_eos(folder):
        (folder / "generation_config.json").write_text('{"eos_token_id": "</s>"}')

    def bad_quant(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": 4}))

    for change, named in ((corrupt_tokenizer, "tokenizer.json: not a tokenizer"),
                          (bad_eos, "eos_token_id='</s>' must be a token id"),
                          (bad_quant, "quantization_config.quant_method=4: not "
                                      "compressed-tensors")):
        folder = broken_copy(checkpoint, tmp_path, change.__name__, change)
        with pytest.raises(CheckpointError, match=named):
            LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=8))


def set_template(template: str):
    def change(folder):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template}))
    return change


def test_a_chat_template_that_fails_is_a_400_never_a_500(checkpoint, tmp_path):
    # raises OverflowError in the sandbox for one message only
    picky = ("{% for m in messages %}{% if m.content == 'boom' %}{{ range(10**9) | list }}"
             "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    folder = broken_copy(checkpoint, tmp_path, "picky", set_template(picky))
    server, thread, url = start_server(folder)
    try:
        wait_healthy(url)
        chat = {"model": "tiny", "max_tokens": 2}
        ok = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            **chat, "messages": [{"role": "user", "content": "Hi"}]})
        assert ok.status_code == 200
        boom = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            **chat, "messages": [{"role": "user", "content": "boom"}]})
        assert boom.status_code == 400
        assert "chat template failed on these messages: OverflowError" in \
            boom.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)

    broken = broken_copy(checkpoint, tmp_path, "broken", set_template("{{ 1 // 0 }}"))
    server, thread, url = start_server(broken)
    try:
        wait_healthy(url)  # completions still serve
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 400
        assert "chat completions are off for this checkpoint: its chat template cannot " \
            "render one user message" in refused.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def test_a_looping_template_at_start_turns_chat_off_and_the_server_serves(checkpoint,
                                                                           tmp_path):
    folder = broken_copy(checkpoint, tmp_path, "spins", set_template(SPIN + "{{ messages }}"))
    server, thread, url = start_server(folder, template_seconds=0.5)
    try:
        wait_healthy(url)
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 400
        assert "chat completions are off for this checkpoint" in refused.text
        assert "did not render these messages within 0.5 s" in refused.text
        ok = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "The", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_template_looping_on_one_request_blocks_no_other_route(checkpoint, tmp_path):
    gated = ("{% if messages[0].content == 'spin' %}" + SPIN + "{% endif %}"
             "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    folder = broken_copy(checkpoint, tmp_path, "gated", set_template(gated))
    # the spinning render runs 3 s; another request waiting on it would take ~2.7 s from
    # `start`, one that does not well under 2 s even on a loaded machine (1.08 s seen in CI)
    server, thread, url = start_server(folder, template_seconds=3.0)
    try:
        wait_healthy(url)
        chat = {"model": "tiny", "max_tokens": 2}
        result: dict = {}
        spinning = threading.Thread(target=lambda: result.update(response=httpx.post(
            f"{url}/v1/chat/completions", timeout=30,
            json={**chat, "messages": [{"role": "user", "content": "spin"}]})))
        spinning.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        other = httpx.post(f"{url}/v1/chat/completions", timeout=5,
                           json={**chat, "messages": [{"role": "user", "content": "Hi"}]})
        assert other.status_code == 200 and time.monotonic() - start < 2.0
        spinning.join(timeout=30)
        assert result["response"].status_code == 400
        assert "did not render these messages within 3 s" in result["response"].text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_one_clients_looping_renders_do_not_hold_up_another_clients_chat(checkpoint,
                                                                          tmp_path):
    """Eight looping renders from one address (1 s limit, two template workers) held a chat
    that came after them for four rounds, first come first served; a chat from another
    address (127.0.0.2) gets the first worker that comes free."""
    gated = ("{% if messages[0].content == 'spin' %}" + SPIN + "{% endif %}"
             "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    folder = broken_copy(checkpoint, tmp_path, "gated", set_template(gated))
    server, thread, url = start_server(folder, template_seconds=1.0)
    chat = {"model": "tiny", "max_tokens": 2}

    def post(address: str, content: str) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address)) as client:
            return client.post(f"{url}/v1/chat/completions", timeout=60, json={
                **chat, "messages": [{"role": "user", "content": content}]})
    try:
        wait_healthy(url)
        assert post("127.0.0.2", "Hi").status_code == 200  # both workers started
        with ThreadPoolExecutor(8) as pool:
            hogs = [pool.submit(post, "127.0.0.1", "spin") for _ in range(8)]
            time.sleep(0.3)
            start = time.monotonic()
            other = post("127.0.0.2", "Hi")
            waited = time.monotonic() - start
            assert [hog.result().status_code for hog in hogs] == [400] * 8
        assert other.status_code == 200 and waited < 2.5, waited
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_huge_max_position_embeddings_allocates_only_what_the_cache_can_hold(checkpoint,
                                                                              tmp_path):
    """A block table a row as wide as 1e10 positions would take 320 GB; no sequence can
    hold more blocks than the cache has."""
    def endless(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(
            {**config, "max_position_embeddings": 10**10}))

    folder = broken_copy(checkpoint, tmp_path, "endless", endless)
    engine = LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=8))
    assert engine.runner.tables.shape[1] == 8
    params = SamplingParams(max_tokens=4, temperature=0)
    assert len(engine.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    with pytest.raises(RequestError, match="need .* KV blocks but the cache has 8"):
        engine.validate([5] * 200, params)


DAMAGE = {
    "empty": lambda f: f.write_bytes(b""),
    "junk": lambda f: f.write_bytes(bytes(range(256)) * 4),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:max(1, f.stat().st_size // 2)]),
    "a folder": lambda f: (f.unlink(), f.mkdir()),
    "a link to itself": lambda f: (f.unlink(), f.symlink_to(f.name)),
    "a link to /dev/zero": lambda f: (f.unlink(), f.symlink_to("/dev/zero")),
    "a FIFO": lambda f: (f.unlink(), os.mkfifo(f)),
    "nested 100k deep": lambda f: f.write_text("[" * 100_000 + "]" * 100_000),
    "a JSON list": lambda f: f.write_text("[]"),
}


def test_every_checkpoint_file_damaged_every_way_is_one_checkpoint_error(checkpoint,
                                                                         tmp_path):
    """Loading for serving (weights, tokenizer, EOS ids, chat template) either works or
    raises CheckpointError — never another exception, a hang or an allocation spree."""
    for file in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        for how, damage in DAMAGE.items():
            folder = tmp_path / f"{file}-{how}".replace(" ", "-")
            shutil.copytree(checkpoint, folder)
            damage(folder / file)
            try:
                LLMEngine.from_checkpoint(folder, EngineConfig(num_blocks=8))
                read_chat_template(folder)
            except CheckpointError:
                pass
            except Exception as error:
                pytest.fail(f"{file} as {how}: {type(error).__name__}: {error}")


def test_health_says_what_loading_waits_for(checkpoint, monkeypatch):
    release = threading.Event()

    def slow_load() -> LLMEngine:
        release.wait(30)
        return LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=8))

    server, thread, url = start_server(checkpoint, slow_load)
    try:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "loading", "detail": f"loading {checkpoint}"}
        monkeypatch.setattr(cpu_native, "_status", "waiting for pid 7 to finish building")
        deadline = time.monotonic() + 10  # the core reports what it waits for twice a second
        while httpx.get(f"{url}/health").json()["detail"] != \
                "waiting for pid 7 to finish building":
            assert time.monotonic() < deadline, "the build's status never reached /health"
            time.sleep(0.05)
        monkeypatch.undo()
        release.set()
        wait_healthy(url)
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=10)
