"""A seeded tiny checkpoint with lathe's trained BPE tokenizer and chat template, and the
real server on it (uvicorn in a thread, on a free loopback port)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import save_checkpoint
from lathe.serve.config import EngineConfig, ServerConfig
from lathe.serve.connections import LatheServer, uvicorn_config
from lathe.serve.engine import LLMEngine
from lathe.serve.server import build_app
from tests.builders import serve_model
from tests.data.corpus import prose


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    tokenizer = train_tokenizer([prose(i, paragraphs=2) for i in range(60)], vocab_size=512,
                                show_progress=False)
    save_tokenizer(tokenizer, root / "tokenizer")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return save_checkpoint(serve_model(vocab), root / "ckpt", tokenizer=root / "tokenizer")


API_KEY = "test-key"


@dataclass
class Running:
    url: str
    engine: Callable[[], LLMEngine]


def start_server(checkpoint, load: Callable[[], LLMEngine] | None = None,
                 **config) -> tuple[LatheServer, threading.Thread, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config.setdefault("engine", EngineConfig())  # eager: a test's server compiles nothing
    server_config = ServerConfig(checkpoint=checkpoint, port=port, served_model_name="tiny",
                                 **config)
    app = build_app(server_config, load=load)
    server = LatheServer(uvicorn_config(app, "127.0.0.1", port, server_config.limits, "error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return server, thread, url


@contextlib.contextmanager
def served(checkpoint, **config) -> Iterator[str]:
    """A server on `checkpoint` (`config`: `ServerConfig` fields), healthy, for the block's
    length; its URL."""
    server, thread, url = start_server(checkpoint, **config)
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_healthy(url: str) -> None:
    # a compiled engine's warm-up takes ~40 s here, more beside the other test worker
    deadline = time.monotonic() + 240
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "model did not load"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def running(checkpoint) -> Iterator[Running]:
    engines: list[LLMEngine] = []

    def load() -> LLMEngine:
        # a small token budget, so that long prompts prefill across several steps
        engines.append(LLMEngine.from_checkpoint(checkpoint, EngineConfig(
            num_blocks=128, max_num_batched_tokens=64)))
        return engines[0]

    server, thread, url = start_server(checkpoint, load, api_key=API_KEY, max_body_bytes=4096)
    wait_healthy(url)
    yield Running(url, lambda: engines[0])
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0)

