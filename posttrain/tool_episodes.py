"""Episodes on the serve engine that alternate model turns and tool results: generate, parse
the reply's tool calls with the server's parser, run them (`lathe.data.tool_runner`),
append the tool messages, and generate again — until a reply without calls, the
`max_tool_turns`-th turn that calls, or the episode's token budget. GRPO rolls out through
it, and the held-out evaluation measures through it; without tools an episode is one turn.

An episode's tokens are the prompt's, then the model's own sampled tokens (its end-of-turn
token included) and, between turns, the tokens the chat template writes for the tool
results up to the next generation prompt — the text after the model's end-of-turn token in
the conversation rendered with the results, so no token the model wrote is re-encoded.
`policy` marks the model's tokens: only they are the policy's actions. Each next turn is
a new request whose prompt is the episode so far, so the engine's prefix cache serves the
earlier turns' blocks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.messages import Message, normalize_message
from lathe.data.tool_runner import ToolRunner
from lathe.data.tools import load_tools
from lathe.posttrain.config import ToolsConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.tool_calls import (
    PARSERS,
    ToolCall,
    ToolCallParser,
    template_tool_call_parser,
    tool_call_parser,
)

Tools = list[dict[str, Any]] | None


@dataclass
class EpisodePrompt:
    ids: list[int]  # the rendered prompt
    messages: list[Message]
    tools: Tools = None


@dataclass
class Episode:
    prompt_ids: list[int]
    messages: list[Message]  # the prompt's, then each assistant turn and tool result
    # after the prompt: the model's tokens and the tool results', in order
    completion_ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)  # True where the model sampled the token
    logprobs: list[float] = field(default_factory=list)  # the engine's; 0.0 on tool tokens
    answer: str = ""  # the last assistant turn's text, its calls left out
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""  # stop, length (token budget), or tool_turns (still calling)
    policy_version: int | None = None  # the oldest weights any of its turns was drawn by
    prompt_messages: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_messages = len(self.messages)

    def transcript(self) -> str:
        """What the episode added to the prompt, in one line: the model's text, its calls
        as `[name(arguments)]` and the tools' answers as `[-> result]`."""
        parts = []
        for message in self.messages[self.prompt_messages:]:
            if message.get("content"):
                text = message["content"]
                parts.append(f"[-> {text}]" if message["role"] == "tool" else text)
            for call in message.get("tool_calls", []):
                function = call["function"]
                parts.append(f"[{function['name']}({json.dumps(function['arguments'])})]")
        return " ".join(parts)

    def add_turn(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.completion_ids += token_ids
        self.policy += [True] * len(token_ids)
        self.logprobs += logprobs or [0.0] * len(token_ids)
        self.turns += 1

    def add_tool_tokens(self, token_ids: list[int]) -> None:
        self.completion_ids += token_ids
        self.policy += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)


class EpisodeRunner:
    """Runs episodes for one chat encoder and tool set (`ToolsConfig`; no tool names: one
    turn each). Owns the tool runner's child processes until `close`."""

    def __init__(self, encoder: ChatEncoder, config: ToolsConfig) -> None:
        self.encoder, self.config = encoder, config
        self.parser = self._parser(encoder, config) if config.names else None
        self.tools = ToolRunner(load_tools(config.names), config.seconds, config.max_chars) \
            if config.names else None

    @staticmethod
    def _parser(encoder: ChatEncoder, config: ToolsConfig) -> ToolCallParser:
        """`tools.parser`, or the format the chat template writes calls in."""
        source = encoder.template.source
        if config.parser:
            return tool_call_parser(config.parser).for_template(source)
        implied = template_tool_call_parser(source)
        if implied is None:
            raise ConfigError(f"tools: {encoder.name} writes no tool calls in a format lathe "
                              f"reads; name the model's with tools.parser ({', '.join(PARSERS)})")
        return implied

    def definitions(self) -> Tools:
        """What a prompt without its own `tools` is offered."""
        return self.tools.definitions() if self.tools is not None else None

    def run(self, engine: LLMEngine, prompts: Sequence[EpisodePrompt],
            params: Sequence[SamplingParams], adapter: str | None = None) -> list[list[Episode]]:
        """`params[i].n` episodes of prompt i, each within `params[i].max_tokens` tokens
        after its prompt; results in order."""
        episodes = [[Episode(list(p.ids), list(p.messages)) for _ in range(sp.n)]
                    for p, sp in zip(prompts, params, strict=True)]
        done = engine.generate([p.ids for p in prompts], list(params), adapter=adapter)
        pending: list[tuple[Episode, EpisodePrompt, SamplingParams, Any]] = []
        for prompt, sp, group, completion in zip(prompts, params, episodes, done, strict=True):
            for index, (episode, out) in enumerate(zip(group, completion.outputs, strict=True)):
                pending.append((episode, prompt, _one(sp, index), out))
        while pending:
            calls = [(episode, prompt, sp,
                      self._close_turn(episode, prompt.tools, out, engine.eos_token_ids))
                     for episode, prompt, sp, out in pending]
            calls = [c for c in calls if c[3]]
            results = self.tools.run_many([(call.name, call.arguments) for *_, turn in calls
                                           for call in turn]) if calls else []
            follow: list[tuple[Episode, EpisodePrompt, SamplingParams]] = []
            at = 0
            for episode, prompt, sp, turn in calls:
                answers, at = results[at:at + len(turn)], at + len(turn)
                if self._add_results(episode, prompt.tools, turn, answers, sp.max_tokens):
                    follow.append((episode, prompt, sp))
            if not follow:
                break
            next_params = [dataclasses.replace(
                sp, n=1, max_tokens=sp.max_tokens - len(e.completion_ids),
                seed=None if sp.seed is None else sp.seed + 7919 * e.turns)
                for e, _, sp in follow]
            done = engine.generate([e.prompt_ids + e.completion_ids for e, _, _ in follow],
                                   next_params, adapter=adapter)
            pending = [(e, p, sp, completion.outputs[0])
                       for (e, p, sp), completion in zip(follow, done, strict=True)]
        return episodes

    def _close_turn(self, episode: Episode, tools: Tools, out: Any,
                    eos: set[int]) -> list[ToolCall]:
        """Record one generated turn; the calls to run before the next, if any."""
        episode.add_turn(out.token_ids, [lp.logprob for lp in out.logprobs])
        episode.policy_version = out.weight_version if episode.policy_version is None \
            else min(episode.policy_version, out.weight_version)
        episode.finish_reason = out.finish_reason or "length"
        if self.parser is None:
            episode.answer = out.text
            episode.messages.append({"role": "assistant", "content": out.text})
            return []
        offered = tools if tools is not None else self.definitions() or []
        content, calls = self.parser.for_tools(offered).split(out.text)
        episode.answer = content
        if not calls:
            episode.messages.append({"role": "assistant", "content": out.text})
            return []
        episode.tool_calls += len(calls)
        calls = [ToolCall(c.name, c.arguments, f"call_{episode.turns}_{i}")
                 for i, c in enumerate(calls)]
        episode.messages.append(normalize_message(
            {"role": "assistant", "content": content or None,
             "tool_calls": [c.to_openai() for c in calls]}, "the model's turn"))
        if not out.token_ids or out.token_ids[-1] not in eos:
            return []  # cut mid-turn (budget or stop string): nothing to answer
        if episode.turns > self.config.max_tool_turns:
            episode.finish_reason = "tool_turns"
            return []
        return calls

    def _add_results(self, episode: Episode, tools: Tools, calls: list[ToolCall],
                     results: list[Any], budget: int) -> bool:
        """Append the tool messages and the template's tokens for them up to the next
        generation prompt; False when they do not fit the budget (the episode ends)."""
        episode.tool_errors += sum(r.error for r in results)
        before = episode.messages
        answers = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r.content}
                   for c, r in zip(calls, results, strict=True)]
        closed = self.encoder.render(before, tools, add_generation_prompt=False)
        opened = self.encoder.render(before + answers, tools)
        cut = self._after_end_of_turn(closed, episode.completion_ids[-1])
        if not opened.startswith(closed[:cut]):
            raise ConfigError(f"{self.encoder.name} renders earlier turns differently once tool "
                              "results follow, so an episode cannot continue the tokens the "
                              "model wrote; give a template that renders them the same way, "
                              "with --chat_template FILE")
        ids = self.encoder.encode(opened[cut:])
        episode.messages = before + answers
        if len(episode.completion_ids) + len(ids) >= budget:
            episode.finish_reason = "length"
            return False
        episode.add_tool_tokens(ids)
        return True

    def _after_end_of_turn(self, closed: str, end_of_turn: int) -> int:
        """Where the template's text after the model's end-of-turn token begins in the
        closed conversation (its end, when the template does not write that token)."""
        token = self.encoder.tokenizer.id_to_token(end_of_turn)
        at = closed.rfind(token) if token else -1
        return at + len(token) if at >= 0 else len(closed)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


def _one(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of a request's n: its own seed for the turns that follow."""
    return dataclasses.replace(params, n=1, seed=None if params.seed is None
                               else params.seed + index)
