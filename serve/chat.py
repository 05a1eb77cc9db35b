"""`lathe chat`: a streaming terminal chat with a local checkpoint or a running server.

Both back ends take the conversation so far and yield the reply's text as it is
generated: `LocalChat` runs an `LLMEngine` in-process through the checkpoint's chat
template, `RemoteChat` reads Server-Sent Events from `/v1/chat/completions`. The loop
keeps the history and understands `/reset`, `/system TEXT` and `/quit`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx

from lathe.data.chat_encoding import chat_encoder
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import QuantMode
from lathe.serve.sampling import SamplingParams

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /quit"


class ChatBackend(Protocol):
    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]) -> Iterator[str]:
        ...


class LocalChat:
    def __init__(self, checkpoint: Path, quantize: QuantMode | None = None,
                 chat_template: Path | None = None) -> None:
        self.engine = LLMEngine.from_checkpoint(checkpoint, quantize=quantize)
        self.encoder = chat_encoder(checkpoint, chat_template, tokenizer=self.engine.tokenizer)

    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]) -> Iterator[str]:
        prompt = self.encoder.prompt(messages)
        room = self.engine.max_model_len - len(prompt)
        params = SamplingParams(**{**sampling, "max_tokens": min(sampling["max_tokens"], room)})
        request_id = self.engine.add_request(prompt, params)
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    yield delta.text
        finally:
            self.engine.abort(request_id)


class RemoteChat:
    """`tools`: OpenAI tool definitions sent with every request; the calls the model makes
    are shown as `[tool call NAME(ARGUMENTS)]` (running them is the caller's business)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.base = url.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model or self._first_model()
        self.tools = tools

    def _first_model(self) -> str:
        response = httpx.get(f"{self.base}/models", headers=self.headers, timeout=30)
        _raise_for_error(response)
        return response.json()["data"][0]["id"]

    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **sampling}
        if self.tools:
            body["tools"] = self.tools
        with httpx.stream("POST", f"{self.base}/chat/completions", json=body,
                          headers=self.headers, timeout=None) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_error(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # the request failed after the stream opened
                    raise RuntimeError(f"server error: {event['error']['message']}")
                for choice in event["choices"]:
                    yield choice["delta"].get("content") or ""
                    for call in choice["delta"].get("tool_calls") or []:
                        function = call.get("function", {})
                        yield (f"\n[tool call {function.get('name')}"
                               f"({function.get('arguments', '')})]")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise RuntimeError(f"server answered {response.status_code}: {message}")


def say(backend: ChatBackend, messages: list[dict[str, str]], sampling: dict[str, Any],
        write: Callable[[str], Any]) -> str:
    """Stream one reply to `write` and return it whole."""
    parts = []
    for text in backend.reply(messages, sampling):
        parts.append(text)
        write(text)
    return "".join(parts)


def write_stdout(text: str) -> None:
    print(text, end="", flush=True)


def chat_loop(backend: ChatBackend, sampling: dict[str, Any], system: str | None,
              read: Callable[[str], str] = input,
              write: Callable[[str], Any] = write_stdout) -> list[dict[str, str]]:
    """Run the conversation until /quit or end of input; returns the final history."""
    history: list[dict[str, str]] = []
    write(HELP + "\n")
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            return history
        if line in ("/quit", "/exit"):
            return history
        if line == "/reset":
            history = []
            write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            system = line.removeprefix("/system").strip() or None
            history = []
            write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        write("assistant> ")
        try:
            answer = say(backend, messages, sampling, write)
        except KeyboardInterrupt:
            answer = ""
        write("\n")
        history.append({"role": "assistant", "content": answer})
