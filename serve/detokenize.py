"""Incremental detokenization: the text each new token adds, never half a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character. Each step decodes a
short window of recent tokens with and without the newest ones and releases the
difference only when it does not end in a replacement character (vLLM's
prefix/read-offset scheme), so the cost per token stays constant. Special tokens are
left out of the text unless `skip_special_tokens` is off (vLLM's default and switch).
"""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = 0  # tokens before this were already released as text

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
