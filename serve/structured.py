"""Structured outputs: a request's constraint — a JSON schema, any JSON object, a regex, one
of a list of strings, or a Lark grammar — compiled by llguidance over the checkpoint's
tokenizer.json, one matcher per sequence, and the tokens each may take next.

llguidance, not xgrammar, because a server meets a new schema with most requests: over
this project's tokenizers llguidance builds a JSON-schema matcher in about 1 ms at a 4k or
32k vocabulary (its lexer is built lazily), where xgrammar's compile took 16 and 129 ms
and grows with the vocabulary, for a per-token mask of tens of microseconds in both
(docs/benchmarks.md has the figures). llguidance also reads tokenizer.json directly and
can roll a matcher back.

`Constraints.compile` turns a `StructuredOutput` into a checked matcher (cached by the
constraint, so repeated schemas cost nothing), raising `GrammarError` naming what is
wrong — with a `GrammarChecker` (the server's), after compiling it in a child process
first, since some grammars crash llguidance's native compile; each sequence gets its own
copy (`Constraints.start`). Each step `allowed_mask`
gives the constrained rows' allowed tokens as a boolean (rows, vocab) tensor, and
`advance` feeds each row the token it drew. Under speculative decoding a draft is cut to
the prefix the grammar takes (`valid_prefix`) and verified against the masks along it
(`draft_masks`, which rolls the matcher back), so accepted and corrected tokens alike
obey the constraint. When the constraint is complete the matcher
allows only EOS, so a constrained sequence ends with "stop" — or "length" when max_tokens
comes first.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer
from torch import Tensor

from lathe.serve.grammar_check import LIMITS, GrammarChecker, GrammarRefused
from lathe.serve.request_checks import RequestError

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex, grammar or choice list past this is refused
CACHE_SIZE = 256


def _fill(matcher: LLMatcher, row: Tensor) -> None:
    """The matcher's allowed-token bitmask written into `row` (int32, contiguous, on the
    host) — what `llguidance.torch` does, without importing it: that module's
    torch.compile decorator imports torch._dynamo, two seconds for every process."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


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


class Constraints:
    """Compiled constraints over one tokenizer, and the matcher of each constrained sequence
    (keyed by whatever the engine uses for a sequence)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 checker: GrammarChecker | None = None):
        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                     eos_token=sorted(eos_token_ids))
        self.checker = checker  # compiles each new grammar in a child process first
        self.limits = LLParserLimits(**LIMITS)
        self._compiled: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in its threads, the engine reads
        self.matchers: dict[object, LLMatcher] = {}
        self._specs: dict[object, StructuredOutput] = {}
        self._bits = torch.arange(32, dtype=torch.int32)

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

    def start(self, key: object, spec: StructuredOutput) -> None:
        self.matchers[key] = self.compile(spec)
        self._specs[key] = spec

    def release(self, key: object) -> None:
        self.matchers.pop(key, None)
        self._specs.pop(key, None)

    def allowed_mask(self, keys: list[object]) -> Tensor:
        """(len(keys), vocab) booleans: the tokens each keyed matcher allows next."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(keys), words), dtype=torch.int32)
        for row, key in enumerate(keys):
            _fill(self.matchers[key], bitmask[row])
        return self._unpack(bitmask)

    def _unpack(self, bitmask: Tensor) -> Tensor:
        bits = (bitmask[:, :, None] >> self._bits) & 1
        return bits.reshape(len(bitmask), -1)[:, :self.vocab_size].bool()

    def valid_prefix(self, key: object, tokens: list[int]) -> int:
        """How many leading `tokens` the matcher of `key` would take (none consumed)."""
        return self.matchers[key].validate_tokens(tokens)

    def draft_masks(self, key: object, tokens: list[int]) -> Tensor:
        """(len(tokens) + 1, vocab): what the matcher of `key` allows before each of
        `tokens` (a draft it takes whole) and after the last, the matcher left as it was."""
        matcher = self.matchers[key]
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(tokens) + 1, words), dtype=torch.int32)
        for row in range(len(tokens) + 1):
            _fill(matcher, bitmask[row])
            if row < len(tokens):
                matcher.consume_token(tokens[row])
        matcher.rollback(len(tokens))
        return self._unpack(bitmask)

    def advance(self, key: object, token: int) -> None:
        """Feed the matcher of `key` its sampled token (one the mask allowed). A matcher
        that fails here (llguidance's lexer limits) raises `GrammarError`, and its compiled
        grammar is dropped from the cache, so the next request compiles a fresh one."""
        matcher = self.matchers[key]
        if not matcher.consume_token(token) or matcher.is_error():
            with self._lock:
                self._compiled.pop(self._specs.get(key), None)
            raise GrammarError(f"token {token} broke the constraint: {matcher.get_error()}")


def constrain(logits: Tensor, rows: list[int], allowed: Tensor) -> Tensor:
    """`logits` with every token a constrained row may not take at -inf (a copy: the
    unconstrained rows, and the raw logits log-probs are taken from, stay untouched)."""
    masked = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    vocab = allowed.shape[1]
    block = masked[index, :vocab].masked_fill(~allowed.to(logits.device), float("-inf"))
    masked[index, :vocab] = block
    masked[index, vocab:] = float("-inf")
    return masked


def structured_constraints(tokenizer: Tokenizer | None, vocab_size: int,
                           eos_token_ids: Iterable[int], checked: bool = False) -> Constraints:
    """The structured-output matchers over a checkpoint's tokenizer; `RequestError` where
    the checkpoint cannot have them. `checked`: each new grammar is compiled in a child
    process first (a server's gate: some grammars crash llguidance)."""
    eos = set(eos_token_ids)
    if tokenizer is None or not eos:
        raise RequestError("structured outputs need the checkpoint's tokenizer.json and an "
                           "EOS token id; this checkpoint lacks one")
    checker = GrammarChecker(tokenizer.to_str(), vocab_size, sorted(eos)) if checked else None
    return Constraints(tokenizer, vocab_size, eos, checker)


def compile_structured(constraints: Constraints, spec: StructuredOutput) -> None:
    """Compile `spec` (cached in `constraints`); `RequestError` when it does not."""
    try:
        constraints.compile(spec)
    except GrammarError as error:
        raise RequestError(f"the structured output does not compile: {error}") from None
