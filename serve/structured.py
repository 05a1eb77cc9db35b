"""Structured outputs: a request's constraint — a JSON schema, any JSON object, a regex, one
of a list of strings, or a Lark grammar — compiled by llguidance over the checkpoint's
tokenizer.json.

llguidance, not xgrammar, because a server meets a new schema with most requests: over
this project's tokenizers llguidance builds a JSON-schema matcher in about 1 ms at a 4k or
32k vocabulary (its lexer is built lazily), where xgrammar's compile took 16 and 129 ms
and grows with the vocabulary, for a per-token mask of tens of microseconds in both
(docs/benchmarks.md has the figures). llguidance also reads tokenizer.json directly and
can roll a matcher back.

`GrammarCompiler.compile` turns a `StructuredOutput` into a checked matcher (cached by the
constraint, so repeated schemas cost nothing), raising `GrammarError` naming what is
wrong — with a `GrammarChecker` (the server's), after compiling it in a child process
first, since some grammars crash llguidance's native compile. No torch here: a server's
front end compiles a request's grammar before sending it; the engine's matchers and masks
are `lathe.serve.constraints`'. Under speculative decoding a draft is cut to the prefix the
grammar takes and verified against the masks along it, so accepted and corrected tokens
alike obey the constraint. When the constraint is complete the matcher allows only EOS,
so a constrained sequence ends with "stop" — or "length" when max_tokens comes first.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer

from lathe.serve.grammar_check import LIMITS, GrammarChecker, GrammarRefused
from lathe.serve.request_checks import RequestError

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex, grammar or choice list past this is refused
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A constraint that does not compile (the message says why)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What one request's output must match; exactly one field is set. `json` is a JSON
    schema as JSON text (`json_object` is the schema {"type": "object"})."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark, or GBNF (told apart by its "::=")
    # a Lark grammar whose `start` admits what comes before the constrained text and names
    # that text `@answer` (a reasoning block: `ReasoningParser.constraint_prefix`)
    prefix: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise GrammarError(f"a structured output is one of json, regex, choice or "
                               f"grammar; got {given or 'none'}")
        size = len(self.json or self.regex or self.grammar or "".join(self.choice or ()))
        if size > MAX_SPEC_CHARS:
            raise GrammarError(f"the {given[0]} constraint has {size:,} characters, more "
                               f"than {MAX_SPEC_CHARS:,}")
        if self.choice is not None and not self.choice:
            raise GrammarError("choice needs at least one string")

    def llguidance_grammar(self) -> str:
        grammar = self._constraint()
        if self.prefix is None:
            return grammar
        try:  # llguidance's grammar JSON (a schema's, a regex's), or Lark text
            inner = json.loads(grammar)["grammars"]
        except (json.JSONDecodeError, TypeError, KeyError):
            inner = [{"lark_grammar": grammar}]
        return json.dumps({"grammars": [{"lark_grammar": self.prefix},
                                        {**inner[0], "name": "answer"}, *inner[1:]]})

    def _constraint(self) -> str:
        if self.json is not None:
            try:
                return LLMatcher.grammar_from_json_schema(
                    self.json, defaults={"whitespace_flexible": False})
            except ValueError as error:
                raise GrammarError(f"the JSON schema is not a JSON object: {error}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            alternatives = " | ".join(json.dumps(option) for option in self.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        assert self.grammar is not None
        lark = self.grammar
        if "::=" in lark:
            try:
                lark = gbnf_to_lark(lark)
            except Exception as error:  # the converter raises whatever its parser meets
                raise GrammarError(f"the GBNF grammar does not convert to Lark: "
                                   f"{error}") from None
        return LLMatcher.grammar_from_lark(lark)


class Literals:
    """How a grammar spells literal text over one tokenizer: each added token in the text
    (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`) as that token
    (`<[id]>`), the rest as quoted text. llguidance treats every added token as special,
    so a quoted `"<tool_call>"` would admit the token in the mask and then refuse it."""

    def __init__(self, added: Mapping[str, int]) -> None:
        self.added = dict(added)
        self._pattern = re.compile("|".join(re.escape(text) for text in sorted(
            self.added, key=len, reverse=True))) if self.added else None

    @classmethod
    def of(cls, tokenizer: Tokenizer | None) -> Literals:
        """The added tokens of `tokenizer` (none without one)."""
        if tokenizer is None:
            return cls({})
        return cls({token.content: token_id
                    for token_id, token in tokenizer.get_added_tokens_decoder().items()})

    def first_added(self, text: str) -> int:
        """Where the first added token in `text` starts (its length when none does)."""
        found = self._pattern.search(text) if self._pattern is not None else None
        return found.start() if found is not None else len(text)

    def __call__(self, text: str) -> str:
        """`text` as a Lark sequence (`""` when empty)."""
        if self._pattern is None:
            return json.dumps(text)
        parts, at = [], 0
        for match in self._pattern.finditer(text):
            if match.start() > at:
                parts.append(json.dumps(text[at:match.start()]))
            parts.append(f"<[{self.added[match.group()]}]>")
            at = match.end()
        if at < len(text) or not parts:
            parts.append(json.dumps(text[at:]))
        return " ".join(parts)


def lark_regex(text: str) -> str:
    """`text` as a Lark regex (between slashes) that matches it literally."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\/.^$|?*+()[]{}" else ch
                   for ch in text)


def text_until(marker: str, literals: Literals, name: str) -> tuple[str, str]:
    """Free text up to and including `marker`, holding no earlier `marker`: a Lark sequence
    and the definition of the lexeme `name` it uses. Text ending in a marker is one lexeme
    (llguidance's lexemes are greedy, so free text and then the marker's text would never
    end); an added token in the marker ends free text by itself."""
    at = literals.first_added(marker)
    head, rest = marker[:at], marker[at:]
    pattern = f"/(.|\\n)*{lark_regex(head)}/ & ~/(.|\\n)*{lark_regex(head)}(.|\\n)+/" \
        if head else "/(.|\\n)*/"
    return name + (f" {literals(rest)}" if rest else ""), f"{name}: {pattern}"


class GrammarCompiler:
    """Constraints compiled over one tokenizer, cached by the constraint (a repeated schema
    costs nothing); with a `GrammarChecker` (a server's) each new grammar is compiled in a
    child process first, since some crash llguidance's native compile."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 checker: GrammarChecker | None = None):
        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                     eos_token=sorted(eos_token_ids))
        self.checker = checker
        self.limits = LLParserLimits(**LIMITS)
        self._compiled: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in its threads, the engine reads

    def compile(self, spec: StructuredOutput) -> LLMatcher:
        """A fresh matcher of `spec` (compiled once, then copied); `GrammarError` when it
        does not compile or exceeds the compile limits."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        grammar = spec.llguidance_grammar()
        if self.checker is not None:
            try:
                self.checker.check(grammar)
            except GrammarRefused as error:
                raise GrammarError(str(error)) from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def forget(self, spec: StructuredOutput | None) -> None:
        """Drop `spec`'s compiled grammar, so the next request compiles a fresh one."""
        with self._lock:
            self._compiled.pop(spec, None)


def grammar_compiler(tokenizer: Tokenizer | None, vocab_size: int,
                     eos_token_ids: Iterable[int], checked: bool = False) -> GrammarCompiler:
    """The structured-output compiler over a checkpoint's tokenizer; `RequestError` where
    the checkpoint cannot have structured outputs. `checked`: each new grammar is compiled
    in a child process first (a server's gate: some grammars crash llguidance)."""
    eos = set(eos_token_ids)
    if tokenizer is None or not eos:
        raise RequestError("structured outputs need the checkpoint's tokenizer.json and an "
                           "EOS token id; this checkpoint lacks one")
    checker = GrammarChecker(tokenizer.to_str(), vocab_size, sorted(eos)) if checked else None
    return GrammarCompiler(tokenizer, vocab_size, eos, checker)


def compile_structured(compiler: GrammarCompiler, spec: StructuredOutput) -> None:
    """Compile `spec` (cached in `compiler`); `RequestError` when it does not."""
    try:
        compiler.compile(spec)
    except GrammarError as error:
        raise RequestError(f"the structured output does not compile: {error}") from None
