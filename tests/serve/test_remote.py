"""A rollout server that fails on the way (busy, restarting: 429, 503) costs a trainer a
retry, not its run: `RemoteEngine` sends the request again after a backoff and gets the
tokens the server would have drawn; an error that retrying cannot fix fails at once, and a
server that keeps failing fails after `max_retries`. A trainer's own server (`LocalServer`)
runs eagerly on the KV cache it is given, leaving the trainer beside it its cores."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from lathe.serve.config import EngineConfig, ServerConfig
from lathe.serve.connections import LatheServer, uvicorn_config
from lathe.serve.engine import LLMEngine
from lathe.serve.remote import LocalServer, RemoteEngine
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.server import build_app
from tests.serve.conftest import wait_healthy


class FailingFirst:
    """The server's app, with its first `failures` completions answered `status` (and a
    Retry-After of 0 s): a server busy or restarting, as a client meets it."""

    def __init__(self, app, failures: int, status: int) -> None:
        self.app, self.failures, self.status = app, failures, status
        self.completions = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            self.completions += 1
            if self.completions <= self.failures:
                await send({"type": "http.response.start", "status": self.status,
                            "headers": [(b"retry-after", b"0"),
                                        (b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "busy"}'})
                return
        await self.app(scope, receive, send)


@contextlib.contextmanager
def failing_server(checkpoint, failures: int, status: int = 503,
                   ) -> Iterator[tuple[str, FailingFirst, LLMEngine]]:
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(checkpoint=checkpoint, port=port, served_model_name="tiny",
                          engine=EngineConfig(num_blocks=64))
    app = FailingFirst(build_app(config, load=lambda: engine), failures, status)
    server = LatheServer(uvicorn_config(app, "127.0.0.1", port, config.limits, "error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.02)
        wait_healthy(url)
        yield url, app, engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_a_busy_server_is_retried_and_gives_the_same_tokens(checkpoint):
    prompt = [5, 6, 7, 8]
    # an engine of its own: the served one is stepped by the server's core thread, which
    # would take some of the steps (and their tokens) of a generate() called beside it
    offline = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    (want,) = offline.generate([prompt], GREEDY)
    with failing_server(checkpoint, failures=2, status=503) as (url, app, engine):
        remote = RemoteEngine(url, engine.eos_token_ids, max_retries=3)
        (completion,) = remote.generate([prompt], GREEDY)
        assert app.completions == 3  # two 503s, then the answer
        assert completion.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(want.outputs[0].token_ids) == GREEDY.max_tokens
        remote.close()


def test_a_server_that_keeps_failing_fails_after_max_retries(checkpoint):
    with failing_server(checkpoint, failures=10, status=429) as (url, app, engine):
        remote = RemoteEngine(url, engine.eos_token_ids, max_retries=2)
        with pytest.raises(RuntimeError, match="answered 429"):
            remote.generate([[5, 6, 7]], GREEDY)
        assert app.completions == 3  # the first try and two retries
        remote.close()


def test_an_error_retrying_cannot_fix_fails_at_once(checkpoint):
    with failing_server(checkpoint, failures=0) as (url, app, engine):
        remote = RemoteEngine(url, engine.eos_token_ids, max_retries=5)
        too_long = SamplingParams(max_tokens=10**6)
        with pytest.raises(RuntimeError, match="answered 400"):
            remote.generate([[5, 6, 7]], too_long)
        assert app.completions == 1
        remote.close()


def test_a_trainers_local_server_runs_eagerly_and_takes_pushes(checkpoint, tmp_path):
    """No compiled step is built behind a trainer's back (a compile takes the cores the
    trainer steps on), and the server answers greedily as the engine in process does."""
    offline = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    (want,) = offline.generate([[5, 6, 7, 8]], GREEDY)
    server = LocalServer(checkpoint, tmp_path, timeout=120, eager=True, num_blocks=64)
    try:
        remote = RemoteEngine(server.url, offline.eos_token_ids, server.api_key)
        (completion,) = remote.generate([[5, 6, 7, 8]], GREEDY)
        assert completion.outputs[0].token_ids == want.outputs[0].token_ids
        metrics = httpx.get(f"{server.url}/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {server.api_key}"}).text
        assert "lathe:num_requests_running" in metrics
        assert "decode_graphs" not in metrics
        remote.close()
    finally:
        server.stop()
