"""The engine's side of structured outputs (`lathe.serve.structured` compiles them): one
llguidance matcher per constrained sequence, the tokens each may take next as a boolean
(rows, vocab) tensor (`allowed_mask`), the masks along a speculative draft (`draft_masks`,
which rolls the matcher back) and the logits with what a row may not take at -inf
(`constrain`)."""

from __future__ import annotations

import torch
from llguidance import LLMatcher
from torch import Tensor

from lathe.serve.structured import GrammarCompiler, GrammarError, StructuredOutput


def _fill(matcher: LLMatcher, row: Tensor) -> None:
    """The matcher's allowed-token bitmask written into `row` (int32, contiguous, on the
    host) — what `llguidance.torch` does, without importing it: that module's
    torch.compile decorator imports torch._dynamo, two seconds for every process."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class Constraints:
    """The matcher of each constrained sequence (keyed by whatever the engine uses for a
    sequence), compiled by `compiler`, and the tokens each may take next."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler, self.vocab_size = compiler, compiler.vocab_size
        self.matchers: dict[object, LLMatcher] = {}
        self._specs: dict[object, StructuredOutput] = {}
        self._bits = torch.arange(32, dtype=torch.int32)

    def start(self, key: object, spec: StructuredOutput) -> None:
        self.matchers[key] = self.compiler.compile(spec)
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
            self.compiler.forget(self._specs.get(key))
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


