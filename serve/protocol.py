"""OpenAI request bodies (pydantic) and the response and chunk JSON the server sends.

Field names and defaults follow OpenAI's API (completions default to 16 tokens, chat to
the rest of the context window); vLLM's extras top_k, min_p, repetition_penalty,
stop_token_ids and ignore_eos are accepted too. Ranges are checked once, by
`SamplingParams`, whose message names the field and its allowed range.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from lathe.serve.engine import CompletionOutput, TokenLogprob
from lathe.serve.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and \
            self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, n=self.n, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content
                       if part.get("type") == "text")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)


def completion_logprobs(tokenizer: Tokenizer | None, logprobs: list[TokenLogprob],
                        offset: int = 0) -> dict[str, list]:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs)."""
    tokens = [_token_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer | None, logprobs: list[TokenLogprob]) -> dict[str, list]:
    """The chat `logprobs.content` list."""
    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}


class ResponseBuilder:
    """Response and chunk bodies of one request (shared id, creation time and model)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str,
                 tokenizer: Tokenizer | None) -> None:
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, outputs: list[CompletionOutput], want_logprobs: bool,
                 prompt_tokens: int) -> dict[str, Any]:
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        choices = []
        for o in outputs:
            if self.kind == "completion":
                logprobs = completion_logprobs(self.tokenizer, o.logprobs) if want_logprobs \
                    else None
                choices.append({"index": o.index, "text": o.text, "logprobs": logprobs,
                                "finish_reason": o.finish_reason})
            else:
                logprobs = chat_logprobs(self.tokenizer, o.logprobs) if want_logprobs else None
                choices.append({"index": o.index, "logprobs": logprobs,
                                "finish_reason": o.finish_reason,
                                "message": {"role": "assistant", "content": o.text}})
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return self._envelope(obj, choices, usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
              finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.kind == "completion":
            choice = {"index": index, "text": text, "finish_reason": finish_reason,
                      "logprobs": None if logprobs is None
                      else completion_logprobs(self.tokenizer, logprobs)}
            return self._envelope("text_completion", [choice])
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None
                  else chat_logprobs(self.tokenizer, logprobs)}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))
