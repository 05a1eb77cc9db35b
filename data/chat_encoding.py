"""Chats as token ids through one chat template: what SFT and distillation train on (ids
and the assistant mask), the prompts GRPO, evaluation and generation start from, and the
prompt/continuation split of a preference pair.

Every text is the template's rendering, tokenized as transformers' `apply_chat_template`
tokenizes it: without the tokenizer's own special tokens (`add_special_tokens=False`), so
a template that writes `bos_token` gets exactly one BOS and one that does not gets none.

The assistant mask comes from the template, by one of two rules:
- the template has `{% generation %}` blocks: their spans, as transformers'
  `return_assistant_tokens_mask` takes them;
- it has none: each assistant message's span is what rendering the conversation through
  that message adds to rendering it up to the message with the generation prompt —
  checked, for every assistant message, to be a prefix of the whole conversation's
  rendering. A template that rewrites an earlier turn once later ones follow (Qwen3 drops
  the reasoning of turns before the last user message) fails that check; the turn is then
  found in the whole rendering instead: it is what changes when the message is replaced
  by a marker, from where the rendering up to it ends (or, when earlier turns changed too,
  right after the template's generation prompt) — the turn as the conversation shows it,
  as the templates' `{% generation %}` versions train it; a template with no generation
  prompt (Mistral, whose system prompt joins the last user message) anchors the turn on
  the text it writes before a reply's content instead; one that refuses the marker in a
  tool call's place (Mistral-Nemo: two replies in a row before the call's results) takes
  the turn from where the rendering through it and one ending on a marker reply first
  differ, found where it occurs once in the whole. Text a template writes only where a
  conversation ends (Phi-3's end-of-text token) and whitespace after a turn's end are
  left out: generation stops at the turn's end token and never writes them. A turn that
  ends where the next one starts (GLM's: the assistant stops by writing `<|user|>` or
  `<|observation|>`, end ids of its generation config) takes that end token into its span,
  and a conversation that ends on such a turn gets the end token the template would
  write next — as the `{% generation %}` versions of those templates place it — or the
  model would never learn to end its turn.
A token is in the mask when it overlaps a span (transformers' rule). A conversation for
which neither rule gives a mask is an error naming the template and the fix, never an
all-zero mask.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from lathe.core.checkpoint_files import read_eos_ids
from lathe.core.errors import ConfigError
from lathe.data.chat_template import REASONING_FIELDS, ChatTemplate, ChatTemplateError, Spans
from lathe.data.formats import Chat, Tools
from lathe.data.messages import Message
from lathe.data.tokenizer import load_tokenizer
from lathe.data.training_templates import training_template

_REASONING = frozenset(REASONING_FIELDS)
# stand-ins for an assistant message, to find where a template renders it
MARKS = ("\u2063lathe-mark-a\u2063", "\u2063lathe-mark-b\u2063")


class ChatMaskError(ConfigError):
    """The template gives no assistant mask (or no clean prompt split) for a chat."""


def _without(messages: list[Message], keys: set[str] | frozenset[str]) -> list[Message]:
    return [{k: v for k, v in m.items() if k not in keys} for m in messages]


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Spans) -> list[bool]:
    """Per token, whether its character range overlaps one of `spans` (both in order)."""
    mask, span = [], 0
    for start, end in offsets:
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        mask.append(span < len(spans) and end > spans[span][0])
    return mask


class ChatEncoder:
    """A tokenizer and a chat template (with its extra variables, e.g. `enable_thinking`);
    `name` says which template in errors ("the chat template of runs/sft/final").
    `training`: the template's training version (`lathe.data.training_templates`), which
    training conversations and preference splits render through; prompts render through
    `template`, as the served model's do."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, name: str,
                 template_kwargs: dict[str, Any] | None = None,
                 end_ids: Sequence[int] = (), training: ChatTemplate | None = None) -> None:
        self.tokenizer, self.template, self.name = tokenizer, template, name
        self.trains_through = training or template
        self.kwargs = dict(template_kwargs or {})
        # the end-of-turn tokens as text, longest first (one may start with another)
        self.ends = sorted({text for text in map(tokenizer.id_to_token, end_ids) if text},
                           key=len, reverse=True)
        self._openers: dict[str, str | None] = {}  # see _reply_opener

    def render(self, messages: list[Message], tools: Tools = None,
               add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt, tools, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, messages: list[Message], tools: Tools = None) -> list[int]:
        """The ids a model continues from: the messages and the generation prompt."""
        return self.encode(self.render(messages, tools))

    def conversation(self, chat: Chat) -> tuple[list[int], list[bool]]:
        """The conversation's ids and, per id, whether the model is trained to write it."""
        try:
            if self.trains_through.has_generation_blocks:
                text, spans = self.trains_through.render_with_spans(
                    chat.messages, False, chat.tools, **self.kwargs)
                spans = [(start, end) for start, end in spans if end > start]
                if not spans:
                    raise self._unmaskable(chat, "its {% generation %} blocks mark nothing in "
                                                 "this conversation")
            else:
                text, spans = self._derived_spans(chat)
            self._check_rendered(chat, text)
        except ChatTemplateError as error:
            raise ConfigError(f"{chat.where}: {self.name} cannot render this chat: "
                              f"{error}") from None
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, overlap_mask(encoding.offsets, spans)

    def drops_system(self, chat: Chat) -> bool:
        """Whether the chat's system message is missing from its training rendering:
        Mistral's templates write it only into a conversation that ends on a user turn, so a
        training chat, which ends on a reply, loses it (transformers renders it so too)."""
        messages = chat.messages
        if not messages or messages[0]["role"] != "system":
            return False
        try:
            return self.trains_through.render(messages, False, chat.tools, **self.kwargs) == \
                self.trains_through.render(messages[1:], False, chat.tools, **self.kwargs)
        except ChatTemplateError:
            return False

    def continuation(self, prompt: list[Message], reply: list[Message], tools: Tools = None,
                     where: str = "") -> tuple[list[int], list[int]]:
        """A preference pair's prompt ids and one reply's ids, split where the rendered
        prompt (with its generation prompt) ends in the rendered conversation (TRL's split);
        for a template that moves part of the prompt once a reply follows (Mistral's system
        prompt), the prompt as served and the reply as the template writes it
        (`_moved_prompt_reply`). Any other template that renders the prompt differently once
        the reply follows is refused."""
        try:
            before = self.trains_through.render(prompt, True, tools, **self.kwargs)
            through = self.trains_through.render(prompt + reply, False, tools, **self.kwargs)
        except ChatTemplateError as error:
            raise ConfigError(f"{where}: {self.name} cannot render this pair: {error}") \
                from None
        if through.startswith(before):
            return self.encode(before), self.encode(through[len(before):].rstrip())
        moved = self._moved_prompt_reply(prompt, tools, before, through)
        if moved is None:
            raise ChatMaskError(
                f"{where}: {self.name} renders the prompt differently once the reply follows "
                f"(the prompt ends {before[-40:]!r}, the conversation has "
                f"{through[len(before) - 40:len(before)]!r} there), so the reply cannot be "
                "split from it; give a template that renders earlier turns the same way, "
                "with --chat_template FILE")
        return self.encode(before), self.encode(moved)

    def _moved_prompt_reply(self, prompt: list[Message], tools: Tools, before: str,
                            through: str) -> str | None:
        """The reply's text in `through` when the template writes part of the prompt
        elsewhere once a reply follows (Mistral's system prompt joins the last user message
        only where the conversation ends on it): what follows the prompt's end — its last
        message's content onwards, as served (`before`) — where the conversation shows it
        before the reply, found ahead of where the conversation and the prompt followed by
        a marker reply first differ (exactly at the marker), so the reply is trained after
        what it is generated after (Mistral's space before it included). None otherwise (a
        generation prompt the conversation does not show, as QwQ's `<think>`)."""
        content = prompt[-1].get("content") if prompt else None
        if not isinstance(content, str) or not content or content not in before:
            return None
        start = self._reply_start(self.trains_through, prompt, tools, through)
        if start is None:
            return None
        tail = before[before.rindex(content):]  # the last message's content onwards
        at = through.rfind(tail, 0, start)
        return None if at < 0 else through[at + len(tail):].rstrip()

    def _derived_spans(self, chat: Chat) -> tuple[str, Spans]:
        messages, tools = chat.messages, chat.tools
        full = self.render(messages, tools, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], tools) if i else ""
            through = self._through(messages[:i + 1], tools,
                                    full if i == len(messages) - 1 else None)
            if through.startswith(before) and full.startswith(through):
                span = (len(before), len(before) + len(through[len(before):].rstrip()))
            elif not (span := self._located_span(messages, i, tools, full, before)):
                raise self._unmaskable(chat, f"rendering the conversation through message {i} "
                                             "is not a prefix of rendering all of it, nor is "
                                             "the message found in it (the template changes "
                                             "a turn depending on what follows)")
            if span[1] > span[0]:
                spans.append(span)
        if not spans:
            raise self._unmaskable(chat, "its assistant messages render as nothing")
        if messages[-1]["role"] == "assistant" and not full[spans[-1][1]:].strip():
            closed = full[:spans[-1][1]]
            if tail := self._next_turn_end(messages, tools, closed):
                full = closed + tail
                spans[-1] = (spans[-1][0], len(full))
            return full, [(s, self._through_end(full, e)) for s, e in spans[:-1]] + spans[-1:]
        return full, [(s, self._through_end(full, e)) for s, e in spans]

    def _located_span(self, messages: list[Message], i: int, tools: Tools, full: str,
                      before: str) -> tuple[int, int] | None:
        """Where assistant message `i` is in the whole conversation's rendering, for a
        template that renders it (or the turns before it) differently once later turns
        follow — Qwen3 drops the reasoning of turns before the last user message: what
        changes when the message is replaced by a marker (the same place for two markers,
        each rendered once). It starts where `before` (the rendering up to the message, with
        the generation prompt) ends when that is a prefix, else right after the template's
        generation prompt. None when the template does not render the message in one such
        place."""
        found = []
        for mark in MARKS:
            marked = [*messages[:i], {"role": "assistant", "content": mark}, *messages[i + 1:]]
            try:
                other = self.render(marked, tools, add_generation_prompt=False)
            except ChatTemplateError:  # a call turned reply breaks the template's role order
                return self._closing_span(messages, i, tools, full)
            suffix = len(os.path.commonprefix([full[::-1], other[::-1]]))
            prefix = len(os.path.commonprefix([full, other]))
            if other.count(mark) != 1 or mark not in other[prefix:len(other) - suffix]:
                return None
            found.append((prefix, len(full) - suffix))
        start, end = found[0]
        if found[0] != found[1] or end <= start:
            return None
        if full.startswith(before):
            return (len(before), end) if start >= len(before) else None
        closed = self.render(messages[:i], tools, add_generation_prompt=False)
        # the generation prompt: what the template adds to open an assistant turn
        header = before[len(closed):] if before.startswith(closed) else ""
        if header:
            return (start, end) if full[:start].endswith(header) else None
        opener = self._reply_opener(tools)
        if opener is None or not full[:start].endswith(opener):
            return None
        return start - len(opener), end

    def _closing_span(self, messages: list[Message], i: int, tools: Tools,
                      full: str) -> tuple[int, int] | None:
        """Where assistant message `i` is in the whole rendering when the conversation
        cannot have a marker reply in its place (Mistral-Nemo's template refuses a tool
        call replaced by a reply before the call's results, as two replies in a row): the
        turn is what the rendering through the message has from where it and the one ending
        on a marker reply instead first differ (exactly at the marker); found there when that
        rendering is a prefix of the whole, else where the turn occurs once in the whole
        (Nemo lists the tools before the last user message, so an earlier call moves). None
        otherwise."""
        through = self._through(messages[:i + 1], tools)
        start = self._reply_start(self.template, messages[:i], tools, through)
        end = len(through.rstrip())
        if start is None or end <= start:
            return None
        if full.startswith(through):
            return start, end
        turn = through[start:end]
        if full.count(turn) != 1:
            return None
        at = full.index(turn)
        return at, at + len(turn)

    def _reply_start(self, template: ChatTemplate, before: list[Message], tools: Tools,
                     through: str) -> int | None:
        """Where the reply that follows the messages `before` starts in `through` (their
        rendering with it): where `template` renders them followed by a marker reply
        differently, if that is exactly at the marker; None otherwise."""
        try:
            other = template.render([*before, {"role": "assistant", "content": MARKS[0]}],
                                    False, tools, **self.kwargs)
        except ChatTemplateError:
            return None
        start = len(os.path.commonprefix([through, other]))
        return start if other[start:].startswith(MARKS[0]) else None

    def _reply_opener(self, tools: Tools) -> str | None:
        """For a template with no generation prompt (Mistral: the reply follows [/INST]),
        what it writes between a user turn and a reply's content (Mistral's space), read off
        the smallest chat: the reply is trained from there, as the template's
        {% generation %} version marks it. None when the smallest chat does not show it.
        Read once per set of tools: every turn of every chat asks."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._openers:
            self._openers[key] = self._read_reply_opener(tools)
        return self._openers[key]

    def _read_reply_opener(self, tools: Tools) -> str | None:
        user: list[Message] = [{"role": "user", "content": "."}]
        try:
            closed = self.render(user, tools, add_generation_prompt=False)
            opened = self.render([*user, {"role": "assistant", "content": MARKS[0]}], tools,
                                 add_generation_prompt=False)
        except ChatTemplateError:  # a template that refuses the smallest chat shows nothing
            return None
        if not opened.startswith(closed) or MARKS[0] not in opened:
            return None
        return opened[len(closed):opened.index(MARKS[0])]

    def _ending(self, text: str) -> str | None:
        """The end token `text` starts with after whitespace (with the whitespace)."""
        stripped = text.lstrip()
        token = next((t for t in self.ends if stripped.startswith(t)), None)
        return None if token is None else text[:len(text) - len(stripped) + len(token)]

    def _through_end(self, full: str, end: int) -> int:
        """An earlier turn's span end moved past the end token that opens the next turn,
        when the span does not close with one itself."""
        if any(full[:end].endswith(token) for token in self.ends):
            return end
        ending = self._ending(full[end:])
        return end if ending is None else end + len(ending)

    def _next_turn_end(self, messages: list[Message], tools: Tools, closed: str) -> str:
        """The end token a conversation that ends on an assistant turn lacks (`closed`: its
        text through that turn): what the template writes when a user turn follows, if that
        is an end token ("" otherwise)."""
        if not self.ends or any(closed.endswith(token) for token in self.ends):
            return ""
        probe = self.render([*messages, {"role": "user", "content": "."}], tools,
                            add_generation_prompt=False)
        return self._ending(probe[len(closed):]) or "" if probe.startswith(closed) else ""

    def _through(self, messages: list[Message], tools: Tools, closed: str | None = None) -> str:
        """The conversation rendered through its last message, less what the template
        writes only when a conversation ends there (Phi-3's end-of-text token): cut where
        the renderings with and without a generation prompt first differ by a token.
        `closed`: the rendering without a generation prompt, when the caller has it."""
        if closed is None:
            closed = self.render(messages, tools, add_generation_prompt=False)
        opened = self.render(messages, tools)
        if opened.startswith(closed):
            return closed
        a = self.tokenizer.encode(closed, add_special_tokens=False)
        b = self.tokenizer.encode(opened, add_special_tokens=False)
        shared = 0
        while (shared < min(len(a.ids), len(b.ids)) and a.ids[shared] == b.ids[shared]
               and a.offsets[shared] == b.offsets[shared]):
            shared += 1
        return closed[:a.offsets[shared][0]] if shared < len(a.ids) else closed

    def _check_rendered(self, chat: Chat, text: str) -> None:
        """A field the record carries must change the rendering: a template that ignores
        reasoning, tool calls or tools would train on a chat without them."""
        messages = chat.messages
        checks = []
        if any(_REASONING.intersection(m) for m in messages):
            checks.append(("reasoning", _without(messages, _REASONING), chat.tools))
        if any("tool_calls" in m for m in messages):
            checks.append(("tool calls", _without(messages, {"tool_calls"}), chat.tools))
        if chat.tools:
            checks.append(("tools", messages, None))
        for what, stripped, tools in checks:
            try:
                ignored = self.trains_through.render(stripped, False, tools,
                                                     **self.kwargs) == text
            except ChatTemplateError:
                ignored = False  # it needs the field, so it renders it
            if ignored:
                raise ConfigError(f"{chat.where}: {self.name} does not render {what} (the "
                                  f"chat renders the same without them), so they would not "
                                  "be trained on; give a template that renders them with "
                                  "--chat_template FILE, or leave them out of the data")

    def _unmaskable(self, chat: Chat, why: str) -> ChatMaskError:
        return ChatMaskError(
            f"{chat.where}: {self.name} gives no assistant mask for this chat: {why}. Give a "
            "template whose {% generation %} ... {% endgeneration %} blocks enclose what the "
            "assistant writes, with --chat_template FILE")


def chat_encoder(checkpoint: str | Path, template_file: str | Path | None = None,
                 template_kwargs: dict[str, Any] | None = None,
                 tokenizer: Tokenizer | None = None) -> ChatEncoder:
    """The encoder of a checkpoint: its tokenizer (unless given), its chat template (or the
    Jinja file `template_file` in its place) and its end ids."""
    template = ChatTemplate.from_checkpoint(checkpoint, template_file)
    name = (f"chat_template={str(template_file)!r}" if template_file is not None
            else f"the chat template of {checkpoint}")
    training = None
    known = None if template.has_generation_blocks else training_template(template.source)
    if known is not None:
        training = ChatTemplate(known[1], template.special_tokens)
        name += f" (trained through TRL's {known[0]}_training version)"
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(checkpoint)
    ends = read_eos_ids(checkpoint, tokenizer.get_vocab_size(with_added_tokens=True))
    return ChatEncoder(tokenizer, template, name, template_kwargs, ends, training)
