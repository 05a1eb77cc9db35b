"""Incremental detokenization: the text each new token adds, never half a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character. Each step decodes a
short window of recent tokens with and without the newest ones and releases the
difference only when it does not end in a replacement character (vLLM's
prefix/read-offset scheme), so the cost per token stays constant.
"""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = 0  # tokens before this were already released as text

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
